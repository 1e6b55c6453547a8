"""Goodput of a local swarm under faults: tokens merged into the global state per second.

    python -m bench.goodput --peers 4 --minutes 10 --out bench/results/goodput.md [-- extra peer flags]

runs three schedules in turn, each on a fresh bootstrap node and N fresh ``python -m peer`` processes on
loopback (the embedded default: tiny model, bundled Shakespeare, unless flags after ``--`` say otherwise),
each peer in its own session so that one ``killpg`` reaches all of it (main process, averager, DHT, p2p
daemon). The clock starts once every peer has finished its first round and runs for --minutes:

- ``none``: no faults;
- ``kill``: about every 2 rounds, SIGKILL a random live peer (``random.Random(0)``; one that has finished a
  round since it last started, so not one still importing torch) and restart it one round later from the
  same --checkpoint-dir (same peer id, resumes its epoch and catches up);
- ``freeze``: about every 3 rounds, SIGSTOP one peer (in turn) for 30 s, then SIGCONT; never two at once;
- ``restart``: about every 2 rounds, SIGKILL a random live peer, as ``kill``, and restart it at once: what a crash
  costs when the peer comes straight back (its restart, the work since its checkpoint, its catch-up).

A kill's dead peer-time (from the kill to the restart) caps what any system keeps: the "ceiling" column is one less
the window's dead peer-time share, and "vs ceiling" the schedule's goodput against its no-fault run, over that.

"About every N rounds": each gap is drawn uniformly from N-0.5 to N+0.5 rounds, so that faults fall at every
phase of a round (inner steps, matchmaking, all-reduce, checkpoint write) rather than always at the one the
first fault happened to hit; the mean gap stays N rounds.

A round is the swarm's measured median round: per peer, the median of its recent gaps between metrics
records, then the median over peers, re-measured at every fault (``round_seconds``).

Why goodput: what a run is for is tokens that reach the global state, and ``tokens_total`` (which every
peer carries in its metrics records and which grows by a group's tokens at each outer step) counts exactly
those. Its growth over the window, divided by the window's seconds, charges every cost of a fault at once:
the tokens of a killed peer's unfinished round (trained, never merged), a frozen peer's 30 s of nothing,
the survivors' extra sync time (a lost member fails an all-reduce, which is retried without it), and a
restarted or thawed peer's catch-up. Tokens trained per second (``tokens`` of the rounds that ended in
the window) is the other side: merged/trained below 1 means work that was done and thrown away (or is
still waiting to be merged at the window's end); above 1, work merged that no record in the window counts
(a killed peer's partial round, resumed from a mid-round checkpoint). Everything is computed from the metrics
files.

``tokens_total`` grows in steps, one per outer step (a round, ~1/10 of the window here), so the window's
growth depends on where its edges fall between two steps: up to a round of tokens either way. The column
"between merges" divides the growth from the window's first outer step to its last by the time between
them, which has no such edge effect.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional

from tests.harness.swarm import PeerProc, Proc, Swarm, read_metrics, signal_group, wait_until

SCHEDULES = ("none", "kill", "freeze", "restart")
KILL_EVERY, FREEZE_EVERY = 2, 3  # rounds, on average
JITTER = 0.5  # rounds either way
FREEZE_SECONDS = 30.0
POLL_SECONDS = 5.0  # longest sleep between looks at the peers, when no event is due sooner
RECENT = 6  # records per peer that the round length is measured over
STOP_SECONDS = 60.0


@dataclass
class Fault:
    kind: str
    peer: int
    start: float
    end: float  # restart or SIGCONT time (wall clock, like the metrics' ``time``)


class Peers:
    """The swarm under one schedule (``tests.harness.swarm.Swarm``: a bootstrap node and real peers), addressed by
    index; a peer restarts under the same index, checkpoint dir and metrics file, with fresh log files."""

    def __init__(self, peers: int, log_dir: Path, run_id: str, peer_args: List[str], slow_every: int = 0,
                 slow_step_seconds: float = 0.0):
        self.swarm = Swarm(log_dir, defaults=["--quiet", "--run-id", run_id, *peer_args])
        self.peers: List[PeerProc] = []
        self.starts, self.restarts = [0] * peers, 0
        self.begun = [0] * peers  # records in each peer's metrics file when it last started
        self.killed: List[PeerProc] = []
        try:
            for i in range(peers):
                slow = ["--min-step-seconds", str(slow_step_seconds)] if slow_every and i % slow_every == 0 else []
                self.peers.append(self.swarm.peer(f"peer{i}", "--checkpoint-dir", str(log_dir / f"peer{i}-ckpt"),
                                                  *slow))
        except BaseException:
            self.swarm.close()
            raise

    def start(self, i: int) -> None:
        """Restart peer ``i`` (killed a round ago) from its checkpoint dir."""
        self.restarts += 1
        self.starts[i] += 1
        self.begun[i] = len(self.peers[i].metrics)
        self.peers[i] = self.swarm.restart(self.peers[i], f"peer{i}.restart{self.starts[i]}")

    def records(self) -> List[List[dict]]:
        return [peer.metrics for peer in self.peers]

    def ready(self, i: int, records: List[List[dict]]) -> bool:
        """Running, and finished a round since it (re)started: past its imports, in the swarm."""
        return self.peers[i].alive() and len(records[i]) > self.begun[i]

    def tend(self) -> None:
        """Between events: a swarm needs no tending; a peer that dies unasked stays dead (``crashed``)."""

    def crashed(self) -> List[str]:
        return [f"{p.name} (rc={p.popen.returncode})" for p in self.peers if not p.alive() and p not in self.killed]

    def signal_group(self, i: int, sig: int) -> None:
        signal_group(self.peers[i], sig)
        if sig == signal.SIGKILL:
            self.peers[i].popen.wait()
            self.killed.append(self.peers[i])

    def close(self) -> Dict[str, Optional[int]]:
        """Stop every live peer (SIGCONT, SIGTERM, up to a minute each), then kill whatever is left. Returns each
        peer's exit code (None: it had to be killed)."""
        try:
            return self.swarm.stop(STOP_SECONDS)
        finally:
            self.swarm.close()


class SyncJob:
    """The synchronous data-parallel baseline (``bench.sync_worker``): N gloo ranks, one job. A rank that
    dies takes the job down; like torchelastic, the driver then stops every rank and relaunches all N at
    once from the last checkpoint. That is generous to the baseline: the dead rank's replacement is there
    at once, while a killed peer of the swarm returns only a round later."""

    def __init__(self, ranks: int, log_dir: Path, worker_args: List[str]):
        self.log_dir, self.worker_args, self.ranks = log_dir, worker_args, ranks
        self.procs: List[Proc] = []
        self.peers: List[Proc] = []
        self.launches, self.begun, self.restarts = 0, 0, 0
        self.crashes: List[str] = []
        self.launch()

    @property
    def metrics_path(self) -> Path:
        return self.log_dir / "rank0.jsonl"

    def launch(self) -> None:
        for proc in self.peers:
            proc.kill_group()
        self.restarts += bool(self.launches)
        self.launches += 1
        self.begun = len(read_metrics(self.metrics_path))
        port = free_port()
        self.peers = []
        for rank in range(self.ranks):
            args = [sys.executable, "-m", "bench.sync_worker", "--rank", str(rank), "--world-size", str(self.ranks),
                    "--port", str(port), "--checkpoint-dir", str(self.log_dir / "ckpt"),
                    "--metrics-file", str(self.metrics_path), *self.worker_args]
            self.peers.append(Proc(args, self.log_dir, f"rank{rank}.launch{self.launches}"))
        self.procs.extend(self.peers)

    def records(self) -> List[List[dict]]:
        return [read_metrics(self.metrics_path)]

    def ready(self, i: int, records: List[List[dict]]) -> bool:
        return self.peers[i].alive() and len(records[0]) > self.begun

    def tend(self) -> None:
        """A rank that died unasked (a collective error, say) takes the job down: relaunch it."""
        dead = [p for p in self.peers if not p.alive()]
        if dead:
            self.crashes.extend(f"{p.name} (rc={p.popen.returncode})" for p in dead)
            self.launch()

    def crashed(self) -> List[str]:
        return self.crashes

    def signal_group(self, i: int, sig: int) -> None:
        signal_group(self.peers[i], sig)
        if sig == signal.SIGKILL:
            self.launch()

    def start(self, i: int) -> None:
        """The swarm restarts a killed peer a round later; the job was relaunched when the rank died."""

    def close(self) -> Dict[str, Optional[int]]:
        for proc in self.procs:
            proc.kill_group()
        return {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def round_seconds(records: List[List[dict]]) -> float:
    """The swarm's median round: per peer, the median gap between its recent records (at least the time since
    its last record: a round that has lasted longer than usual so far is at least that long), then over peers.
    So a swarm that stalls spaces its faults out instead of being hit faster than it can recover."""
    per_peer, now = [], time.time()
    for rows in filter(None, records):
        times = [r["time"] for r in rows[-RECENT:]]
        gaps = [b - a for a, b in zip(times, times[1:])] or [rows[-1]["compute_seconds"] + rows[-1]["sync_seconds"]]
        per_peer.append(max(statistics.median(gaps), now - times[-1]))
    return statistics.median(per_peer)


def inject(schedule: str, swarm: "Peers | SyncJob", end: float, rng: random.Random) -> List[Fault]:
    """Run the schedule's faults until ``end``; sleeps until the next event (at most POLL_SECONDS)."""
    faults: List[Fault] = []
    dead: Dict[int, float] = {}  # peer -> when to restart it
    frozen: Optional[Fault] = None
    every = {"kill": KILL_EVERY, "restart": KILL_EVERY, "freeze": FREEZE_EVERY}.get(schedule)
    kills = schedule in ("kill", "restart")
    def gap(length: float) -> float:
        return rng.uniform(every - JITTER, every + JITTER) * length

    next_fault = time.time() + gap(round_seconds(swarm.records())) if every else float("inf")
    while time.time() < end:
        now = time.time()
        for i, at in sorted(dead.items()):
            if now >= at:
                del dead[i]
                swarm.start(i)
        if frozen is not None and now >= frozen.end:
            swarm.signal_group(frozen.peer, signal.SIGCONT)
            frozen = None
        swarm.tend()
        if now >= next_fault:
            records = swarm.records()
            length = round_seconds(records)
            ready = [i for i in range(len(swarm.peers)) if i not in dead and swarm.ready(i, records)]
            if kills and not ready:
                next_fault = now + length
            elif kills:
                victim = rng.choice(ready)
                swarm.signal_group(victim, signal.SIGKILL)
                dead[victim] = now + (length if schedule == "kill" else 0.0)
                faults.append(Fault("kill", victim, now, dead[victim]))
                next_fault = now + gap(length)
            else:
                frozen = Fault("freeze", len(faults) % len(swarm.peers), now, now + FREEZE_SECONDS)
                swarm.signal_group(frozen.peer, signal.SIGSTOP)
                faults.append(frozen)
                next_fault = max(now + gap(length), frozen.end)
        due = [end, next_fault, *dead.values(), *([frozen.end] if frozen else [])]
        time.sleep(max(0.0, min(min(due) - time.time(), POLL_SECONDS)))
    return faults


def survivor(record: dict, peer: int, faults: List[Fault], records: List[dict]) -> bool:
    """False for a record of a peer whose round overlapped its own fault: a frozen peer's round, or a killed
    peer's first round after its restart (downloads and catch-up)."""
    began = record["time"] - record["compute_seconds"] - record["sync_seconds"]
    for fault in faults:
        if fault.peer != peer:
            continue
        end = fault.end
        if fault.kind == "kill":
            end = min((r["time"] for r in records if r["time"] > fault.end), default=float("inf"))
        if began < end and record["time"] > fault.start:
            return False
    return True


def summarize(records: List[List[dict]], start: float, end: float, faults: List[Fault]) -> dict:
    """The window's figures, from metrics records alone."""
    before = [r for rows in records for r in rows if r["time"] <= start]
    until = [r for rows in records for r in rows if r["time"] <= end]
    inside = [(i, r) for i, rows in enumerate(records) for r in rows if start < r["time"] <= end]
    seconds = end - start
    merged = max(r["tokens_total"] for r in until) - max(r["tokens_total"] for r in before)
    trained = sum(r["tokens"] for _, r in inside)
    survivors = [r["sync_seconds"] for i, r in inside if survivor(r, i, faults, records[i])]
    last = [[r for r in rows if r["time"] <= end][-1] for rows in records if any(r["time"] <= end for r in rows)]
    losses = [r["loss"] for r in last if r["loss"] is not None]
    # merge events in the window: the state at each tokens_total, first reported at this time
    events = sorted({tokens: min(r["time"] for _, r in inside if r["tokens_total"] == tokens)
                     for tokens in {r["tokens_total"] for _, r in inside}}.items())
    between = ((events[-1][0] - events[0][0]) / (events[-1][1] - events[0][1])
               if len(events) > 1 and events[-1][1] > events[0][1] else float("nan"))
    dead = sum(max(0.0, min(f.end, end) - max(f.start, start)) for f in faults if f.kind == "kill")
    return dict(
        seconds=seconds, faults=len(faults), goodput=merged / seconds, trained=trained / seconds, between=between,
        ceiling=1 - dead / (len(records) * seconds),
        ratio=merged / trained if trained else float("nan"),
        rounds=max(r["epoch"] for r in until) - max(r["epoch"] for r in before),
        median_sync=statistics.median(r["sync_seconds"] for _, r in inside) if inside else float("nan"),
        worst_sync=max(survivors, default=float("nan")),
        loss=statistics.median(losses) if losses else float("nan"),
        unapplied=[r.get("error") or "no group" for _, r in inside if not r["applied"]],
    )


def shared_flags(args) -> List[str]:
    """Flags both systems get: the same model, batch, H, threads and step pacing."""
    flags = ["--threads", "1", "--min-step-seconds", str(args.min_step_seconds)]
    for name in ("batch_size", "inner_steps"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


def run_schedule(system: str, schedule: str, args, root: Path) -> dict:
    log_dir = root / system / schedule
    log_dir.mkdir(parents=True)
    if system == "swarm":
        job = Peers(args.peers, log_dir, f"goodput-{schedule}", [*shared_flags(args), *args.peer_args],
                    args.slow_every, args.slow_step_seconds)
    else:
        job = SyncJob(args.peers, log_dir, shared_flags(args))
    try:
        def first_rounds():
            for proc in job.peers:
                if not proc.alive():
                    raise SystemExit(f"{proc.name} exited (rc={proc.popen.returncode}):\n{proc.stderr[-2000:]}")
            return all(job.records())
        wait_until(first_rounds, 900, "every peer's first round", interval=1.0)
        start = time.time()
        end = start + args.minutes * 60
        faults = inject(schedule, job, end, random.Random(0))
        crashed = job.crashed()
    finally:
        codes = job.close()
    stats = summarize(job.records(), start, end, faults)
    name = "peer" if system == "swarm" else "rank"
    stats.update(system=system, schedule=schedule, log_dir=log_dir, crashed=crashed, codes=codes,
                 restarts=job.restarts, events=[f"{f.kind} {name}{f.peer} at +{f.start - start:.0f}s "
                                                f"({f.end - f.start:.0f}s)" for f in faults])
    return stats


def table(results: List[dict]) -> str:
    lines = ["| system | schedule | faults | restarts | goodput tok/s | vs its no-fault run | vs swarm, no faults "
             "| between merges tok/s | vs its no-fault run | merged/trained | rounds | median sync s "
             "| worst survivor sync s | final loss | ceiling | vs ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    swarm_base = next((r["goodput"] for r in results if (r["system"], r["schedule"]) == ("swarm", "none")),
                      float("nan")) or float("nan")  # nothing merged: no ratio
    for r in results:
        base = next((b for b in results if (b["system"], b["schedule"]) == (r["system"], "none")),
                    dict(goodput=float("nan"), between=float("nan")))
        base = {k: v or float("nan") for k, v in base.items() if k in ("goodput", "between")}  # nothing merged
        swarm = r["system"] == "swarm"
        between = (f"{r['between']:,.0f} | {r['between'] / base['between']:.0%}" if math.isfinite(r["between"])
                   else "- | -")  # fewer than two merges in the window, or tokens_total fell (a restart)
        vs_swarm = f"{r['goodput'] / swarm_base:.0%}" if math.isfinite(swarm_base) else "-"  # no swarm rows
        sync = f"{r['median_sync']:.2f} | {r['worst_sync']:.1f}" if swarm else "- | -"
        lines.append(f"| {r['system']} | {r['schedule']} | {r['faults']} | {r['restarts']} | {r['goodput']:,.0f} | "
                     f"{r['goodput'] / base['goodput']:.0%} | {vs_swarm} | {between} | "
                     f"{r['ratio']:.2f} | {r['rounds']} | {sync} | {r['loss']:.3f} | {r['ceiling']:.1%} | "
                     f"{r['goodput'] / base['goodput'] / r['ceiling']:.0%} |")
    return "\n".join(lines)


def notes(results: List[dict]) -> str:
    lines = []
    for r in results:
        why = "; ".join(f"{r['unapplied'].count(e)}x {e}" for e in sorted(set(r["unapplied"])))
        codes = ", ".join(f"{name} {'killpg' if code is None else code}" for name, code in r["codes"].items())
        lines.append(f"- {r['system']}, {r['schedule']}: {r['seconds']:.0f} s window; faults: "
                     f"{', '.join(r['events']) or 'none'}; rounds not applied: {len(r['unapplied'])}"
                     f"{f' ({why})' if why else ''}; exited unasked: {', '.join(r['crashed']) or 'none'}"
                     + (f"; exit codes on SIGTERM: {codes}" if r["system"] == "swarm" else "")
                     + f"; logs: {r['log_dir']}")
    return "\n".join(lines)


def header(argv: List[str], peers: int) -> str:
    command = shlex.join(["python", "-m", "bench.goodput", *argv])
    return (f"# Goodput of a {peers}-peer swarm under faults, against synchronous data-parallel training\n\n"
            f"Command ({os.cpu_count()} CPU threads, loopback, --threads 1 per process):\n\n    {command}\n\n"
            f"Measured {datetime.date.today().isoformat()}, torch {version('torch').split('+')[0]} CPU, "
            f"hivemind {version('hivemind')}:\n\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4, help="swarm peers, and ranks of the baseline")
    parser.add_argument("--minutes", type=float, default=10.0, help="measured wall time per schedule")
    parser.add_argument("--systems", default="swarm,sync", help="comma-separated: swarm, sync (the baseline)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated, of {SCHEDULES}")
    parser.add_argument("--min-step-seconds", type=float, default=1.5,
                        help="every process pads its inner steps to this long, so that N processes sharing "
                             "this machine's cores each train at one fixed pace, like N machines")
    parser.add_argument("--slow-every", type=int, default=0,
                        help="every this many swarm peers, one is a slower device (0: none)")
    parser.add_argument("--slow-step-seconds", type=float, default=6.0, help="a slower device's seconds per step")
    parser.add_argument("--batch-size", type=int, help="sequences per step per process (default: the preset's)")
    parser.add_argument("--inner-steps", type=int, help="H, and the baseline's checkpoint interval in steps")
    parser.add_argument("--out", type=Path, help="also write the table, with how it was measured, here")
    parser.add_argument("peer_args", nargs="*", help="extra flags for every swarm peer (after --)")
    args = parser.parse_args(argv)
    systems, schedules = args.systems.split(","), args.schedules.split(",")
    if set(systems) - {"swarm", "sync"} or set(schedules) - set(SCHEDULES):
        parser.error(f"--systems takes swarm and/or sync, --schedules some of {SCHEDULES}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERMed driver still cleans up
    root = Path(tempfile.mkdtemp(prefix="goodput_"))
    print(f"logs and metrics: {root}", flush=True)
    results = []
    for system in systems:
        for schedule in schedules:
            results.append(run_schedule(system, schedule, args, root))
            print(f"{system}, {schedule}: {results[-1]['goodput']:,.0f} tok/s merged, {results[-1]['faults']} faults, "
                  f"{results[-1]['restarts']} restarts", flush=True)
    report = f"{table(results)}\n\n{notes(results)}\n"
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header(argv, args.peers) + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
