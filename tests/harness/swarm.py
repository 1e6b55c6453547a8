"""Real swarms for tests and benchmarks: ``python -m dht`` and ``python -m peer`` processes on loopback.

Every process runs in its own session, so a test can SIGKILL a whole peer (main process, averager,
DHT, p2p daemon) with one killpg, and ``Swarm.close`` reaps everything a test started.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
MADDR = re.compile(r"/ip4/\S+/p2p/\S+")

# small and fast: a round is 5 steps of 4x64 tokens on the micro model, each padded to 0.2 s: rounds of ~1 s
# that leave the CPU to the other processes of a test (peers, their DHTs and p2p daemons). The test swarms pin the
# wire settings they were written against (fp16, the first moment every 4 rounds, whole rounds, syncs between
# rounds), which their byte and timing bounds assume; the defaults (int4-huffman, no alignment, overlap) are run by
# tests of their own (tests/test_fragments.py, tests/test_status.py)
FAST_RUN = ("--model", "micro", "--batch-size", "4", "--seq-len", "64", "--inner-steps", "5", "--grace-seconds", "2",
            "--min-step-seconds", "0.2",
            "--eval-every", "2", "--eval-batches", "2", "--lr", "0.003", "--warmup-steps", "5",
            "--compression", "fp16", "--align-every", "4")
FAST_NODE = ("--quiet", "--threads", "1", "--no-overlap",
             "--allreduce-timeout", "10", "--part-timeout", "3", "--request-timeout", "1")


def wait_until(predicate: Callable[[], Optional[T]], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``predicate`` until it returns a truthy value; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def in_a_thread(call: Callable[[], T]) -> concurrent.futures.Future:
    """``call()`` in a daemon thread, its outcome a future: a call that waits for good holds neither the test nor its
    process's exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(call())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def read_metrics(path: Path) -> List[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


class Proc:
    """A child process in its own session with stdout/stderr in files."""

    def __init__(self, args: List[str], log_dir: Path, name: str, wrap: Callable[[List[str]], List[str]] = list):
        self.name, self.args = name, wrap(args)
        self.stdout_path, self.stderr_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
        # a temp dir of its own, removed when it is killed: a SIGKILLed process runs no exit handler, and each left
        # multiprocessing's pymp-* directory in /tmp (826 of them after a few days of suites and benchmarks)
        self.tmp = tempfile.mkdtemp(prefix="proc-")
        # (faulthandler: a process that will not exit is made to say where its threads wait, ``wait``)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", TMPDIR=self.tmp)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(self.args, stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout)
            self.remove_tmp()
            return code
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:.0f}s; its stderr, ending with where each "
                                 f"of its threads waited:\n{self.stacks()[-6000:]}") from None

    def stacks(self) -> str:
        """Its stderr, after faulthandler wrote there where each thread of the process is (SIGABRT: it dies of it)."""
        self.signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        return self.stderr

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the process, its group, and the groups of its descendants (torchrun starts each rank
        in a session of its own, and so does torch_shm_manager), then remove its temp dir."""
        pids = [self.popen.pid, *descendants(self.popen.pid)]
        groups = set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        for group in groups | {self.popen.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.popen.wait()
        # a SIGKILLed peer's shared tensors outlive it in /dev/shm (torch's file_system strategy; its
        # torch_shm_manager died in the same process group): a suite would leak gigabytes over a day
        for pid in pids:
            for leftover in glob.glob(f"/dev/shm/torch_{pid}_*"):
                with contextlib.suppress(OSError):
                    os.remove(leftover)
        self.remove_tmp()

    def remove_tmp(self, timeout: float = 10) -> None:
        """Remove the process's temp dir once no torch shared-memory manager uses it.

        ``torch_shm_manager`` (started by the first shared tensor) runs in a session of its own and leaves about 2 s
        after its last client, so it outlives a peer that exits by itself. It keeps its socket in a
        ``torch-shm-dir-*`` of ``TMPDIR`` and removes that as it exits; removed under it, it exits printing
        ``terminate called after throwing an instance of 'std::system_error' what(): No such file or directory``
        into the peer's stderr. (``kill_group`` kills it with the rest: nothing to wait for there.)
        """
        with contextlib.suppress(AssertionError):  # one that outlived that: remove its dir all the same
            wait_until(lambda: not shm_managers(self.tmp), timeout, "torch_shm_manager to leave", interval=0.05)
        shutil.rmtree(self.tmp, ignore_errors=True)


def shm_managers(tmp: str) -> List[int]:
    """The live torch_shm_manager processes whose ``TMPDIR`` is ``tmp`` (/proc's comm keeps 15 characters of a
    name; a zombie's environ reads empty)."""
    found, mark = [], f"TMPDIR={tmp}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                if not comm.read().startswith("torch_shm_manag"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if mark in environ.read():
                    found.append(int(pid))
        except OSError:
            pass  # gone, or not ours to read
    return found


def descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid`` (from /proc: children of children, and so on)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError):
                children = [int(c) for c in Path(f"/proc/{parent}/task/{task}/children").read_text().split()]
                found.extend(children)
                frontier.extend(children)
    return found


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # field 4, after the name


def p2p_daemons(pid: int) -> List[int]:
    """The p2p daemons among ``pid``'s descendants (a DHT's, one per node)."""
    return [child for child in descendants(pid) if Path(f"/proc/{child}/comm").read_text().strip() == "p2pd"]


def peer_command(*args: str, harness: Sequence[str] = ()) -> List[str]:
    """``python -m peer ARGS``, or with harness flags (a fault plan, misbehaviour) ``python -m tests.harness``."""
    return [sys.executable, "-m", "tests.harness" if harness else "peer", *harness, *args]


class PeerProc(Proc):
    def __init__(self, args: List[str], log_dir: Path, name: str, wrap: Callable[[List[str]], List[str]] = list,
                 harness: Sequence[str] = (), metrics_path: Optional[Path] = None):
        self.peer_args, self.harness = list(args), tuple(harness)
        self.metrics_path = metrics_path or log_dir / f"{name}.jsonl"
        super().__init__(peer_command(*args, "--metrics-file", str(self.metrics_path), harness=harness), log_dir,
                         name, wrap)

    @property
    def metrics(self) -> List[dict]:
        return read_metrics(self.metrics_path)

    def reached(self, done: Callable[[List[dict]], bool]) -> bool:
        """Whether ``done(metrics)`` holds; raises when the process exited before it did (nothing to wait for)."""
        if done(self.metrics):
            return True
        if not self.alive() and not done(self.metrics):  # read again: the last record lands before the exit
            raise AssertionError(f"{self.name} exited early (rc={self.popen.returncode}):\n{self.stderr[-3000:]}")
        return False

    def wait_rounds(self, count: int, timeout: float) -> List[dict]:
        wait_until(lambda: self.reached(lambda metrics: len(metrics) >= count), timeout,
                   f"{self.name} to finish {count} rounds")
        return self.metrics


class Swarm:
    """A bootstrap node plus the peers a test or benchmark starts; ``close`` kills them all.

    ``net`` (a ``docker.netns.TestNetwork``): the bootstrap listens on the network's host address, and
    ``peer(..., namespace=i)`` runs a peer inside namespace i; without it, everything is on loopback.
    ``defaults``: the flags every peer gets before its own (the fast test settings unless told otherwise)."""

    def __init__(self, log_dir: Path, net=None, defaults: Sequence[str] = (*FAST_RUN, *FAST_NODE)):
        self.log_dir, self.procs, self.net, self.defaults = log_dir, [], net, tuple(defaults)
        self.host = net.host_ip if net is not None else "127.0.0.1"
        self.bootstrap = self.track(Proc([sys.executable, "-m", "dht", "--host-maddrs", f"/ip4/{self.host}/tcp/0"],
                                          log_dir, "bootstrap"))
        self.maddr = wait_until(lambda: (MADDR.findall(self.bootstrap.stdout) or [None])[0], 60,
                                "the bootstrap node's multiaddr")

    def track(self, proc: Proc) -> Proc:
        """Have ``close`` kill ``proc`` too (an observer, a second DHT node: any process a test starts beside the
        swarm's peers), whether or not the test reaches its own cleanup."""
        self.procs.append(proc)
        return proc

    def peer(self, name: str, *args: str, join: bool = True, namespace: Optional[int] = None,
             wrap: Callable[[List[str]], List[str]] = list, faults: Optional[str] = None,
             byzantine: Optional[str] = None, metrics_path: Optional[Path] = None,
             new_run: bool = True, start_method: Optional[str] = None) -> PeerProc:
        """``python -m peer`` with the swarm's defaults; ``wrap`` rewrites its command line (e.g. torchrun).
        ``faults`` (a fault plan, ``tests/harness/faults.py``), ``byzantine`` (``misbehaviour.py``) and
        ``start_method`` (multiprocessing's, set before the peer starts) run it under the harness instead.
        ``metrics_path``: another metrics file than NAME.jsonl (a restart's, say). Peers that join start the run
        too if it is not there yet (``--new-run``: several start at once), unless not ``new_run``."""
        extra = ["--initial-peers", self.maddr, *(("--new-run",) if new_run else ())] if join else []
        host = self.host
        if namespace is not None:
            host, wrap = self.net.ip(namespace), lambda argv: self.net.wrap(namespace, argv)
        harness = [*(("--fault-plan", faults) if faults else ()), *(("--byzantine", byzantine) if byzantine else ()),
                   *(("--start-method", start_method) if start_method else ())]
        args = [*self.defaults, "--host-maddrs", f"/ip4/{host}/tcp/0", *extra, *args]
        return self.track(PeerProc(args, self.log_dir, name, wrap, harness, metrics_path))

    def restart(self, proc: PeerProc, name: str, harness: Optional[Sequence[str]] = None) -> PeerProc:
        """``proc``'s command again under a new name (fresh log files), appending to the same metrics file;
        ``harness``: its harness flags (None: ``proc``'s; (): none, so that a fault plan strikes only once)."""
        return self.track(PeerProc(proc.peer_args, self.log_dir, name, metrics_path=proc.metrics_path,
                                    harness=proc.harness if harness is None else harness))

    def stop(self, timeout: float) -> Dict[str, Optional[int]]:
        """SIGCONT then SIGTERM every live peer and wait up to ``timeout`` seconds each for it to leave; returns
        each one's exit code (None: it did not leave in time). ``close`` still kills whatever is left."""
        live = [p for p in self.procs if isinstance(p, PeerProc) and p.alive()]
        for proc in live:
            signal_group(proc, signal.SIGCONT)
            proc.signal(signal.SIGTERM)
        codes: Dict[str, Optional[int]] = {}
        for proc in live:
            try:
                codes[proc.name] = proc.wait(timeout)
            except AssertionError:
                codes[proc.name] = None
        return codes

    def close(self) -> None:
        for proc in self.procs:
            proc.kill_group()


def signal_group(proc: Proc, sig: int) -> None:
    """Signal the process group of ``proc`` (one peer: its process, averager, DHT and p2p daemon), gone or not."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.popen.pid, sig)


def by_epoch(peers: List[PeerProc]) -> Dict[int, Dict[str, dict]]:
    """{epoch: {peer name: its metrics record}} over every applied round."""
    table: Dict[int, Dict[str, dict]] = {}
    for peer in peers:
        for record in peer.metrics:
            if record["applied"]:
                table.setdefault(record["epoch"], {})[peer.name] = record
    return table


def assert_all_leave(peers: List[PeerProc], timeout: float = 60) -> None:
    """SIGTERM every peer at once, then each must leave cleanly (exit 0, no C++ abort from a child) within
    ``timeout`` seconds."""
    for peer in peers:
        peer.signal(signal.SIGTERM)
    for peer in peers:
        assert peer.wait(timeout) == 0, peer.stderr[-3000:]
        assert "terminate called" not in peer.stderr, peer.stderr[-3000:]


def assert_groups_agree(peers: List[PeerProc]) -> int:
    """In every epoch, all members of a group report the same state hash; returns the (record, member) pairs checked.
    A peer may apply twice at one epoch: it left a fork for a state of as many epochs or fewer (the fork choice
    counts tokens), and its new group stepped that one. So a member agrees if one of its records at the epoch holds
    the hash (a 2|2 split that healed: a pair's round at epoch 5, then one of them at epoch 5 again with the others)."""
    checked = 0
    names = {}
    applied: Dict[Tuple[int, str], List[dict]] = {}  # (epoch, peer id) -> its applied records at that epoch
    for peer in peers:
        for record in peer.metrics:
            if record["applied"]:
                names[record["peer_id"]] = peer.name
                applied.setdefault((record["epoch"], record["peer_id"]), []).append(record)
    for (epoch, peer_id), records in applied.items():
        for record in records:
            for member in record["group"]:
                others = applied.get((epoch, member))
                if others:
                    assert any(o["state_hash"] == record["state_hash"] for o in others), (
                        f"epoch {epoch}: {names[peer_id]} and {names.get(member, member)} were in one group but "
                        f"hold {record['state_hash']} and {', '.join(o['state_hash'] for o in others)}"
                    )
                    checked += 1
    return checked


def assert_loss_fell(peers: List[PeerProc], by: float = 0.5) -> None:
    """Every peer's last round ends ``by`` below the loss the swarm started from: the largest of the peers' first
    rounds. (A peer that started second downloads a trained state first, so its own first loss is no start: in
    one CI run p0 began at 3.38, not 4.64, and fell 0.49 in 19 rounds.)"""
    start = max(peer.metrics[0]["loss"] for peer in peers)
    for peer in peers:
        losses = [round(r["loss"], 2) for r in peer.metrics]
        assert losses[-1] < start - by, f"{peer.name}: loss did not fall from the swarm's {start:.2f}: {losses}"
