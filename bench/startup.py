"""Startup: seconds from launching ``python -m peer`` to its first inner step, for two commits side by side.

    python -m bench.startup --before 8ea003b --after HEAD --runs 7 --out bench/results/startup.md

Each commit runs from a ``git worktree`` of its own. Each launch is a real ``python -m peer --quiet
--checkpoint-dir DIR`` in its own session, in one of three modes:

- ``fresh``: DIR empty, no initial peers: the peer builds the default run (tiny) and starts it alone;
- ``resumed``: DIR a copy of a checkpoint that the same commit wrote (tiny, one round of 10 steps), no peers;
- ``rejoin``: the same copy, with ``--initial-peers`` of a bootstrap node beside a peer that holds the run at the
  checkpoint's state (a copy of it with another identity, one step every 120 s): a restart into its swarm, as in
  bench/goodput.py's kills, less the state download (the swarm has not moved on).

A probe in front of ``peer.__main__`` stamps the first inner step's start and end in seconds since the process
started (its start time in /proc/self/stat, as the peers' ``startup_seconds``), then SIGKILLs the process group (the
copy of the checkpoint is never written to). Launches alternate between the commits, one unmeasured round first,
so both see the same machine and a warm disk cache. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
MODES = ("fresh", "resumed", "rejoin")
LOOPBACK = ("--host-maddrs", "/ip4/127.0.0.1/tcp/0")
MADDR = re.compile(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+")

PROBE = """
import os, sys, time
def age():
    with open("/proc/self/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started
import peer.train.inner as inner
step = inner.InnerTrainer.step
def first_step(self, *args, **kwargs):
    print(f"STARTUP begins {age():.3f}", file=sys.stderr, flush=True)
    step(self, *args, **kwargs)
    print(f"STARTUP ends {age():.3f}", file=sys.stderr, flush=True)
    os.killpg(0, 9)
inner.InnerTrainer.step = first_step
from peer.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


class Commit:
    """A worktree of one commit, and how to run Python in it (its own ``diloco_compression`` too)."""

    def __init__(self, label: str, ref: str, scratch: Path):
        self.label, self.ref = label, ref
        here = ref == "."
        self.sha = git("rev-parse", "--short", "HEAD" if here else ref) + (" and its working tree" if here else "")
        self.root = ROOT if ref == "." else scratch / label  # ".": this checkout as it is, uncommitted changes too
        if ref != ".":
            git("worktree", "add", "--detach", str(self.root), ref)
        shim = scratch / f"{label}-shim"  # the package installs compression/ as diloco_compression
        shim.mkdir()
        (shim / "diloco_compression").symlink_to(self.root / "compression")
        self.env = dict(os.environ, PYTHONPATH=f"{self.root}{os.pathsep}{shim}")
        self.checkpoint = scratch / f"{label}-checkpoint"
        self.swarm: List[subprocess.Popen] = []
        self.maddr: Optional[str] = None

    def popen(self, argv: List[str], log: Path, nice: int = 0) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, *argv], cwd=self.root, env=self.env, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        if nice:  # the scheduler shares CPU between sessions (autogroups) first: the session's niceness counts
            Path(f"/proc/{proc.pid}/autogroup").write_text(str(nice))
        return proc

    def prepare(self, scratch: Path, modes) -> None:
        """The checkpoint the resumed launches copy; for ``rejoin``, a bootstrap node and a peer holding its state."""
        done = self.popen(["-m", "peer", "--quiet", "--max-rounds", "1", "--inner-steps", "10", "--checkpoint-dir",
                           str(self.checkpoint)], scratch / f"{self.label}-checkpoint.log")
        if done.wait(600) != 0:
            raise SystemExit(f"{self.label}: writing the checkpoint failed; see {scratch}/{self.label}-checkpoint.log")
        if "rejoin" not in modes:
            return
        log = scratch / f"{self.label}-bootstrap.log"
        self.swarm.append(self.popen(["-m", "dht", *LOOPBACK], log))
        self.maddr = wait_for(lambda: (MADDR.findall(log.read_text()) or [None])[0], 60, "the bootstrap's address")
        holder = scratch / f"{self.label}-holder"
        shutil.copytree(self.checkpoint, holder)
        (holder / "identity.key").unlink()  # another peer: its own identity, the same state
        log = scratch / f"{self.label}-holder.log"
        self.swarm.append(self.popen(["-m", "peer", "--quiet", "--checkpoint-dir", str(holder), "--initial-peers",
                                      self.maddr, *LOOPBACK, "--threads", "1", "--min-step-seconds", "120"], log))
        wait_for(lambda: "run key" in log.read_text(), 120, f"{self.label}'s holder to join its swarm")

    def launch(self, mode: str, scratch: Path, index: int, nice: int) -> Tuple[float, float]:
        directory = scratch / f"{self.label}-{mode}-{index}"
        if mode == "fresh":
            directory.mkdir()
        else:
            shutil.copytree(self.checkpoint, directory)
        peers = ("--initial-peers", self.maddr, *LOOPBACK) if mode == "rejoin" else ()
        log = scratch / f"{self.label}-{mode}-{index}.log"
        proc = self.popen(["-c", PROBE, "--quiet", "--checkpoint-dir", str(directory), *peers], log, nice)
        try:
            proc.wait(300)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)
            raise SystemExit(f"{self.label} {mode}: no first inner step within 300 s; see {log}") from None
        stamps = dict(re.findall(r"STARTUP (begins|ends) ([\d.]+)", log.read_text()))
        shutil.rmtree(directory)
        if len(stamps) != 2:
            raise SystemExit(f"{self.label} {mode}: no first inner step (exit {proc.returncode}); see {log}")
        return float(stamps["begins"]), float(stamps["ends"])

    def close(self) -> None:
        for proc in self.swarm:  # throwaway: the holder's step lasts 120 s, a SIGTERM would wait for it
            with_group(proc, signal.SIGKILL)
            proc.wait(60)
        if self.ref != ".":
            git("worktree", "remove", "--force", str(self.root))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def with_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # each was started in a session of its own: its group is its pid
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise SystemExit(f"gave up waiting for {what} after {timeout:.0f} s")


def spread(values: List[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def report(args, commits: List[Commit], results: Dict[Tuple[str, str], List[Tuple[float, float]]],
           loads: Tuple[str, str]) -> str:
    before, after = commits
    measured = (f"Measured {datetime.date.today()}: before = {before.sha} ({args.before}), after = {after.sha} "
                f"({args.after}); {args.runs} launches per commit and mode after one unmeasured round, alternating "
                f"between the commits, their sessions at niceness {args.nice}; load average at the start {loads[0]}, "
                f"at the end {loads[1]}. Seconds since the process started (min / median / max):")
    lines = [
        "# Startup: launch to the first inner step, before and after", "",
        "Command (this machine: " + f"{os.cpu_count()} CPU cores, no GPU; Python {sys.version.split()[0]}):", "",
        "    " + " ".join(["python -m bench.startup", *sys.argv[1:]]), "",
        textwrap.fill(measured, 116), "",
        "| mode | first step begins, before | after | ratio of medians | first step ends, before | after | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        old, new = results[(before.label, mode)], results[(after.label, mode)]
        begins = [statistics.median(s[0] for s in runs) for runs in (old, new)]
        ends = [statistics.median(s[1] for s in runs) for runs in (old, new)]
        lines.append(f"| {mode} | {spread([s[0] for s in old])} | {spread([s[0] for s in new])} | "
                     f"{begins[0] / begins[1]:.2f}x | {spread([s[1] for s in old])} | {spread([s[1] for s in new])} | "
                     f"{ends[0] / ends[1]:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="8ea003b", help="the commit measured first (default: 8ea003b)")
    parser.add_argument("--after", default="HEAD", help="the commit it is compared with (default: HEAD; '.': this "
                                                        "checkout, uncommitted changes included)")
    parser.add_argument("--runs", type=int, default=7, help="measured launches per commit and mode (default: 7)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--nice", type=int, default=0,
                        help="run the measured launches' sessions at this niceness (below 0, as root: ahead of other "
                             "work on a busy machine, which then stands aside as on a quiet one; default: 0)")
    parser.add_argument("--out", type=Path, help="write the results table here (markdown) as well as printing it")
    args = parser.parse_args()
    results: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch_dir:
        scratch, commits = Path(scratch_dir), []
        try:
            for label, ref in (("before", args.before), ("after", args.after)):
                commits.append(Commit(label, ref, scratch))
                commits[-1].prepare(scratch, args.modes)
            loads = [open("/proc/loadavg").read().split()[:3]]
            for index in range(args.runs + 1):  # round 0 warms the disk cache, and is not counted
                for mode in args.modes:
                    for commit in commits:
                        stamps = commit.launch(mode, scratch, index, args.nice)
                        print(f"{index} {mode:8s} {commit.label:6s} begins {stamps[0]:6.2f} ends {stamps[1]:6.2f}",
                              flush=True)
                        if index:
                            results.setdefault((commit.label, mode), []).append(stamps)
            loads.append(open("/proc/loadavg").read().split()[:3])
        finally:
            for commit in commits:
                commit.close()
    text = report(args, commits, results, tuple(" ".join(load) for load in loads))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
