"""Compute utilization of a 4-peer swarm over emulated WAN links, with and without overlap, against hivemind.

    nice -n 19 python -m bench.wan --out bench/results/wan.md     # the full matrix (root): about an hour
    nice -n 19 python -m bench.wan --quick                         # a smoke run: 3-6 minutes

The full matrix is 18 swarms of 4, each ~3 minutes (startup, a first round, 3 measured rounds of 30 s):
56 minutes measured on a busy 2-core machine. ``--presets tiny`` or ``--rounds 2`` cut it to about half or
by ~10 minutes.

For every model preset and link, one namespace network (``docker.netns.TestNetwork``: a namespace per
worker on a bridge, tbf for the rate, the user-space forwarder for the delay) carries three systems in
turn, each with a fresh bootstrap node (``tests.harness.swarm.Swarm``) and 4 fresh workers, one per namespace:

- ``diloco``: ``python -m peer``, each round's sync (matchmaking, all-reduce, outer step) between two
  inner phases: the plain DiLoCo baseline;
- ``overlap``: the same with ``--overlap``: the sync runs while the next round trains (docs/design.md, step 8);
- ``hivemind``: ``bench.hivemind_worker``, hivemind.Optimizer with ``use_local_updates=True`` on the same
  model, data, batch and pacing; an epoch (one parameter averaging) is the same samples as a round;
- ``hivemind-blocking`` (on request): the same with ``delay_state_averaging=False``;
- any ``--variant NAME='FLAGS'``: ``python -m peer`` with those flags on top of the others (``--fragments 4
  --overlap``, say); a variant whose flags hold ``--overlap`` is measured as overlapped.

With ``--join-late`` the last worker starts only once every other has finished its first round, as a volunteer
joins a swarm mid-run: the notes then say how many rounds each worker applied.

Links are the named ones in ``LINKS``, or any ``RATEmbit-RTTms`` (``20mbit-100ms``: 20 Mbit/s each way, 50 ms one way).

Rounds are ``--round-seconds`` of compute (``--round-seconds`` for the peers; for hivemind, a target batch of
that many paced steps on every worker). Every worker pads its steps to ``--min-step-seconds`` (a slower
device), so that 4 workers on a small machine each train at a fixed pace and together need under a core.

The metric, per worker: compute seconds / wall seconds over ``--rounds`` rounds after the first (joining,
the first group). The window runs from the worker's first record to its record ``rounds`` later, and holds
exactly ``rounds`` inner phases: for a peer without overlap the rounds of those records, for an overlapped
peer (which writes round k's record once its sync is joined, at the end of round k+1's inner phase) the
rounds one later; for hivemind the steps between two epoch changes. Compute is what each worker counts as
its inner steps (forward, backward, optimizer step, pacing pad); everything else in the wall time is the
cost of synchronising. The peers' time is split further from their records: sync (what the training loop
waited for its sync) and the rest (round bookkeeping, schedule lookups, publishing); and what one sync sent through
the transport (its records' ``bytes_sent``: the burst a household's uplink takes at once), mean and most. Bytes are
the wire bytes through each namespace's link (all traffic, TCP/IP headers included) over the window, per round, and
"link busy" the seconds per round in which a worker's link carried more than ``BUSY_MBIT``: the all-reduce
moving its tensors, as the network saw it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from docker.netns import TestNetwork, available
from peer.config import NodeConfig, RunConfig
from tests.harness.swarm import ROOT, PeerProc, Proc, Swarm, read_metrics

SYSTEMS = ("diloco", "overlap", "hivemind", "hivemind-blocking")
DEFAULT_SYSTEMS = SYSTEMS[:3]  # hivemind-blocking (delay_state_averaging=False) on request
PACE = {"tiny": 2.0, "small": 4.0}  # default --min-step-seconds per preset: above a step's compute here, loaded
STARTUP_SECONDS = 240.0  # imports, p2p daemons, joining: under load, 4 workers starting at once take a while
POLL_SECONDS = 0.1  # how often the driver samples the links and looks for new records
SAMPLE_SECONDS = 0.1  # link counter resolution: an all-reduce over 1 Gbit/s moves a tiny model's delta in ~0.1 s
BUSY_MBIT = 20.0  # a link carrying more than this is moving tensors (DHT and matchmaking traffic stay below)


@dataclass(frozen=True)
class Link:
    name: str
    rate_mbit: Optional[float]  # each way, per worker's link (tbf); None: unshaped veths
    delay_ms: float  # one way between two workers (TestNetwork's delay_ms), so the round trip is twice this

    def describe(self) -> str:
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unlimited"
        return f"{rate}, {2 * self.delay_ms:g} ms RTT" if self.delay_ms else rate


LINKS = {link.name: link for link in (Link("unlimited", None, 0.0), Link("1gbit-100ms", 1000.0, 50.0),
                                      Link("100mbit-100ms", 100.0, 50.0))}
LINK_NAME = re.compile(r"^(\d+(?:\.\d+)?)mbit-(\d+(?:\.\d+)?)ms$")


def link_named(name: str) -> Optional[Link]:
    """A named link, or ``RATEmbit-RTTms``; None for anything else."""
    if name in LINKS:
        return LINKS[name]
    match = LINK_NAME.match(name)
    return Link(name, float(match.group(1)), float(match.group(2)) / 2) if match else None


# ---------------------------------------------------------------- workers
def peer_flags(args, preset: str, system: str) -> List[str]:
    """One peer's flags: the run (same for all 4) and this node's pace; defaults where a real run keeps them. With
    ``--round-seconds``, H is that much compute (``--fragments F``: a round is 1/F of it), and ``--inner-steps`` only
    counts the schedules' steps: it is rounded up to a multiple of F."""
    pace, fragments = pace_of(args, preset), fragments_of(args, system)
    steps = -(-max(1, round(args.round_seconds / pace)) // fragments) * fragments
    return ["--model", preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--inner-steps", str(steps), "--warmup-steps", str(steps), "--round-seconds", str(args.round_seconds),
            "--grace-seconds", str(args.grace_seconds), "--eval-every", str(args.eval_every),
            "--run-id", f"wan-{preset}", "--threads", "1", "--min-step-seconds", str(pace), "--quiet",
            *args.peer_args, *system_flags(args, system)]


def system_flags(args, system: str) -> List[str]:
    """The flags that make a system of the peers what it is."""
    if system in ("diloco", "overlap"):
        return ["--overlap" if system == "overlap" else "--no-overlap"]
    return shlex.split(args.variants.get(system, ""))


def fragments_of(args, system: str) -> int:
    """F of this system's peers (the last --fragments given, else the default)."""
    flags = [*args.peer_args, *system_flags(args, system)] if not system.startswith("hivemind") else []
    given = [int(flags[i + 1]) for i, flag in enumerate(flags[:-1]) if flag == "--fragments"]
    return given[-1] if given else RunConfig().fragments


def overlapped(args, system: str) -> bool:
    """Does this system's peer sync in the background (the last of --overlap / --no-overlap, else the default)?"""
    if system.startswith("hivemind"):
        return False
    said = [flag for flag in (*args.peer_args, *system_flags(args, system)) if flag in ("--overlap", "--no-overlap")]
    return said[-1] == "--overlap" if said else NodeConfig().overlap


def pace_of(args, preset: str) -> float:
    return args.min_step_seconds or PACE.get(preset, 4.0)


def start_workers(swarm: Swarm, net: TestNetwork, system: str, preset: str, args, log_dir: Path,
                  indices: range) -> List[Proc]:
    workers = []
    for i in indices:
        host = f"/ip4/{net.ip(i)}/tcp/0"
        wrap = (lambda i: lambda argv: net.wrap(i, argv))(i)
        if system.startswith("hivemind"):
            pace = pace_of(args, preset)
            target = args.peers * args.batch_size * max(1, round(args.round_seconds / pace))
            argv = [sys.executable, "-m", "bench.hivemind_worker", "--initial-peers", swarm.maddr,
                    "--host-maddrs", host, "--run-id", f"wan-hm-{preset}", "--model", preset,
                    "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                    "--target-batch-size", str(target), "--matchmaking-time", str(args.grace_seconds),
                    "--min-step-seconds", str(pace), "--threads", "1", "--shard", str(i),
                    "--warmup-steps", str(max(1, round(args.round_seconds / pace))),  # as the peers
                    *(["--no-delay-state-averaging"] if system == "hivemind-blocking" else []),
                    "--metrics-file", str(log_dir / f"w{i}.jsonl")]
            proc = Proc(argv, log_dir, f"w{i}", wrap)
            proc.metrics_path = log_dir / f"w{i}.jsonl"
        else:
            argv = [*peer_flags(args, preset, system), "--host-maddrs", host, "--initial-peers", swarm.maddr,
                    "--new-run"]
            if args.checkpoints:  # written (and fsynced) on the training thread at every round's end
                argv += ["--checkpoint-dir", str(log_dir / f"p{i}-checkpoint")]
            proc = PeerProc(argv, log_dir, f"p{i}", wrap)
        swarm.track(proc)
        workers.append(proc)
    return workers


class LinkMeter:
    """Wire bytes through each namespace's link, sampled every ``SAMPLE_SECONDS`` from the host side (sysfs
    counters of the link's host end: no process to start, so sampling costs next to nothing).

    ``at(i, t)``: (sent, received) by namespace i at time t; ``busy(i, start, end)``: seconds in which its link
    carried more than ``BUSY_MBIT`` (the all-reduce's data moving; DHT chatter stays far below)."""

    def __init__(self, net: TestNetwork):
        # the host end of namespace i's link (a veth, or the TAP its forwarder serves): what it receives is what
        # the namespace sent
        self.paths = [Path(f"/sys/class/net/{net._veth(i)}/statistics") for i in range(net.size)]
        self.samples: List[List[Tuple[float, int, int]]] = [[] for _ in self.paths]
        self.last = 0.0

    def sample(self) -> None:
        if time.monotonic() - self.last < SAMPLE_SECONDS:
            return
        self.last = time.monotonic()
        now = time.time()
        for path, series in zip(self.paths, self.samples):
            received = int((path / "rx_bytes").read_text())  # by the host end: sent by the namespace
            sent = int((path / "tx_bytes").read_text())
            series.append((now, received, sent))

    def at(self, i: int, when: float) -> Tuple[int, int]:
        """The last sample at or before ``when``."""
        before = [s for s in self.samples[i] if s[0] <= when] or self.samples[i][:1]
        return before[-1][1], before[-1][2]

    def busy(self, i: int, start: float, end: float) -> float:
        series = [s for s in self.samples[i] if start <= s[0] <= end]
        seconds = 0.0
        for (t0, s0, r0), (t1, s1, r1) in zip(series, series[1:]):
            if (s1 - s0 + r1 - r0) * 8 / 1e6 / max(t1 - t0, 1e-6) > BUSY_MBIT:
                seconds += t1 - t0
        return seconds


def run_system(system: str, preset: str, link: Link, net: TestNetwork, args, log_dir: Path) -> dict:
    """Start 4 workers, wait until each has the records its window needs (or the time is up), stop them."""
    log_dir.mkdir(parents=True)
    shift = overlapped(args, system)
    rounds = args.rounds * fragments_of(args, system)  # the same compute for every system: F rounds make one H
    need = rounds + 1 + shift  # records: the first, the window's, and overlap's one more
    swarm = Swarm(log_dir, net)
    meter = LinkMeter(net)
    problems: List[str] = []
    started = time.monotonic()
    first = args.peers - 1 if args.join_late else args.peers  # the others, then the late joiner
    deadline = started + STARTUP_SECONDS + (args.rounds + 2 + args.join_late) * (args.round_seconds + 90)
    try:
        workers = start_workers(swarm, net, system, preset, args, log_dir, range(first))
        records, looked = [], 0.0
        while True:
            meter.sample()
            if time.monotonic() - looked < 0.5:
                time.sleep(POLL_SECONDS)
                continue
            looked = time.monotonic()
            records = [read_metrics(w.metrics_path) for w in workers]
            if len(workers) < args.peers and all(records):  # every other worker finished its first round
                workers += start_workers(swarm, net, system, preset, args, log_dir, range(first, args.peers))
                continue
            if len(workers) == args.peers and all(len(rows) >= need for rows in records):
                break
            dead = [f"{w.name} exited (rc={w.popen.returncode}): {tail(w.stderr)}" for w in workers if not w.alive()]
            if dead or time.monotonic() > deadline:
                problems += dead or [f"timed out after {time.monotonic() - started:.0f}s with "
                                     f"{[len(rows) for rows in records]} records of {need}"]
                break
    finally:
        swarm.close()
    result = summarize(system, [read_metrics(w.metrics_path) for w in workers], meter, rounds, shift)
    result.update(system=system, preset=preset, link=link.name, log_dir=log_dir, problems=problems,
                  seconds=time.monotonic() - started, fragments=fragments_of(args, system))
    return result


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------- figures
def window(system: str, rows: List[dict], rounds: int, shift: int) -> Optional[dict]:
    """One worker's figures over its window (see the module docstring); None if it has too few records. ``shift``:
    1 for an overlapped peer, whose record of round k comes at the end of round k+1's inner phase."""
    if len(rows) < rounds + 1 + shift:
        return None
    wall = rows[rounds]["time"] - rows[0]["time"]
    compute = sum(r["compute_seconds"] for r in rows[1 + shift: rounds + 1 + shift])
    figures = dict(wall=wall, compute=compute, utilization=compute / wall, round_wall=wall / rounds)
    if not system.startswith("hivemind"):
        syncs = rows[1: rounds + 1]
        waited = sum(r["sync_seconds"] for r in syncs)
        sent = [r["bytes_sent"] for r in syncs if r["applied"]] or [0]
        figures.update(waited=waited, other=wall - compute - waited, sync_sent=statistics.mean(sent),
                       sync_peak=max(sent),
                       sync_wall=statistics.median(r.get("sync_wall_seconds", r["sync_seconds"]) for r in syncs),
                       steps=statistics.mean(r["inner_steps"] for r in rows[1 + shift: rounds + 1 + shift]))
    else:
        figures.update(steps=statistics.mean(r["inner_steps"] for r in rows[1: rounds + 1]))
    return figures


def summarize(system: str, records: List[List[dict]], meter: LinkMeter, rounds: int, shift: int = 0) -> dict:
    per_worker = [window(system, rows, rounds, shift) for rows in records]
    done = [(i, w) for i, w in enumerate(per_worker) if w is not None]
    result = dict(workers=len(records), measured=len(done), rounds=rounds)
    if not done:
        return result
    spans = [(i, records[i][0]["time"], records[i][rounds]["time"]) for i, _ in done]
    traffic = [tuple((b - a) / rounds for a, b in zip(meter.at(i, start), meter.at(i, end))) for i, start, end in spans]
    busy = [meter.busy(i, start, end) / rounds for i, start, end in spans]
    figures = [w for _, w in done]
    result.update(
        utilization=statistics.mean(w["utilization"] for w in figures),
        utilization_min=min(w["utilization"] for w in figures),
        round_wall=statistics.mean(w["round_wall"] for w in figures),
        compute=statistics.mean(w["compute"] / rounds for w in figures),
        steps=statistics.mean(w["steps"] for w in figures),
        sent=statistics.mean(t[0] for t in traffic), received=statistics.mean(t[1] for t in traffic),
        busy=statistics.mean(busy),
        loss=statistics.mean(rows[-1]["loss"] for rows in records if rows and rows[-1].get("loss") is not None),
    )
    if system.startswith("hivemind"):
        result.update(hivemind_groups(records, rounds))
    else:
        result.update(
            waited=statistics.mean(w["waited"] / rounds for w in figures),
            other=statistics.mean(w["other"] / rounds for w in figures),
            sync_wall=statistics.median(w["sync_wall"] for w in figures),
            sync_sent=statistics.mean(w["sync_sent"] for w in figures),
            sync_peak=max(w["sync_peak"] for w in figures),
            **agreement(records),
        )
    return result


def agreement(records: List[List[dict]]) -> dict:
    """Did every group end each round on one state? Forks (two states at one epoch), rounds not applied,
    retried all-reduces and group sizes, over all of a swarm's records."""
    by_epoch: Dict[int, List[dict]] = {}
    for rows in records:
        for r in rows:
            if r["applied"]:
                by_epoch.setdefault(r["epoch"], []).append(r)
    split, forks = [], []
    for epoch, rows in sorted(by_epoch.items()):
        hashes = {r["peer_id"]: r["state_hash"] for r in rows}
        if any(hashes.get(member, r["state_hash"]) != r["state_hash"] for r in rows for member in r["group"]):
            split.append(epoch)
        if len(set(hashes.values())) > 1:
            forks.append(epoch)
    everything = [r for rows in records for r in rows]
    return dict(
        agreed=not split, split=split, forks=forks, epochs=len(by_epoch),
        unapplied=[r.get("error") or "no group" for r in everything if not r["applied"]],
        retried=sum(1 for r in everything if (r.get("attempts") or 0) > 1),
        applied_each=[f"{sum(r['applied'] for r in rows)}/{len(rows)}" for rows in records],
        group_sizes=sorted({r["group_size"] for r in everything}),
    )


def hivemind_groups(records: List[List[dict]], rounds: int) -> dict:
    groups = [g for rows in records for r in rows[1: rounds + 1] for g in r.get("groups", [])]
    failures = sum(r.get("failures", 0) for rows in records for r in rows[1: rounds + 1])
    return dict(group_sizes=sorted(set(groups)), averaged=len(groups), failures=failures)


# ---------------------------------------------------------------- report
def megabytes(count: float) -> str:
    return f"{count / 1e6:.1f}"


def table(results: List[dict]) -> str:
    lines = ["| preset | link | system | utilization mean | min | round wall s | compute s/round | sync wall s "
             "(median) | waited s/round | other s/round | link busy s/round | MB sent/round | MB recv/round "
             "| F | MB sent/H | MB a sync sent (mean / most) | state hashes | loss (last) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        head = f"| {r['preset']} | {link_named(r['link']).describe()} | {r['system']} "
        if not r.get("measured"):
            lines.append(head + "| not measured: " + "; ".join(r["problems"]) + " |" + " |" * 14)
            continue
        partial = f" ({r['measured']}/{r['workers']} workers)" if r["measured"] < r["workers"] else ""
        if r["system"].startswith("hivemind"):
            sync, bursts = "| - | - | - ", "-"
            hashes = "n/a (local updates: replicas differ by design)"
        else:
            sync = f"| {r['sync_wall']:.2f} | {r['waited']:.2f} | {r['other']:.2f} "
            bursts = f"{megabytes(r['sync_sent'])} / {megabytes(r['sync_peak'])}"
            hashes = "agree" if r["agreed"] else f"split at epochs {r['split']}"
            hashes += f"; forks at {r['forks']}" if r["forks"] else ""
            hashes += f"; {len(r['unapplied'])} rounds not applied" if r["unapplied"] else ""
        lines.append(head + f"| {r['utilization']:.3f}{partial} | {r['utilization_min']:.3f} | {r['round_wall']:.1f} | "
                     f"{r['compute']:.1f} " + sync + f"| {r['busy']:.2f} | {megabytes(r['sent'])} | "
                     f"{megabytes(r['received'])} | {r.get('fragments', 1)} | "
                     f"{megabytes(r['sent'] * r.get('fragments', 1))} | {bursts} | {hashes} | {r['loss']:.3f} |")
    return "\n".join(lines)


def notes(results: List[dict]) -> str:
    lines = []
    for r in results:
        bits = [f"{r['seconds']:.0f} s"]
        if r.get("measured") and not r["system"].startswith("hivemind"):
            why = "; ".join(f"{r['unapplied'].count(e)}x {e}" for e in sorted(set(r["unapplied"])))
            bits.append(f"epochs {r['epochs']}, group sizes {r['group_sizes']}, retried all-reduces {r['retried']}, "
                        f"rounds not applied {len(r['unapplied'])}" + (f" ({why})" if why else "")
                        + f", rounds applied by each worker {', '.join(r['applied_each'])}")
        elif r.get("measured"):
            bits.append(f"averaging rounds in the window {r['averaged']} (group sizes {r['group_sizes']}), "
                        f"failed {r['failures']}")
        bits += r["problems"]
        lines.append(f"- {r['preset']}, {r['link']}, {r['system']}: " + "; ".join(bits) + f"; logs: {r['log_dir']}")
    return "\n".join(lines)


def progress_line(r: dict) -> str:
    figures = (f"utilization {r['utilization']:.3f} (min {r['utilization_min']:.3f})" if r.get("measured")
               else "not measured")
    return f"{r['preset']}, {r['link']}, {r['system']}: {figures}, {r['seconds']:.0f} s; " + "; ".join(r["problems"])


def head_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip() or "?"


def header(argv: List[str], args) -> str:
    command = shlex.join(["python", "-m", "bench.wan", *argv])
    paces = ", ".join(f"{p} {pace_of(args, p):g} s" for p in args.presets)
    commit = args.commit if args.commit == head_commit() else f"{args.commit}..{head_commit()} (committed meanwhile)"
    return (f"# Compute utilization over WAN links: {args.peers} peers, with and without overlap, and "
            f"hivemind.Optimizer\n\n"
            f"Command (as root, at niceness {os.nice(0)}, {os.cpu_count()} CPU threads, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end, one namespace per worker):\n\n"
            f"    {command}\n\n"
            f"Measured {datetime.date.today().isoformat()} at commit {commit}, "
            f"torch {version('torch').split('+')[0]} CPU, hivemind "
            f"{version('hivemind')}; H of {args.round_seconds:g} s of compute (a round, or F rounds with fragments), "
            f"{args.rounds} of them measured per worker after the first round; batch {args.batch_size} x "
            f"{args.seq_len} tokens, steps paced to {paces}"
            + "".join(f"; {name} = `{flags}`" for name, flags in args.variants.items()) + ":\n\n")


def start_driver(prefix: str) -> Optional[Path]:
    """Before a benchmark's namespace swarms: the network's check (None, said in one line, where it is missing), a
    SIGTERM that still reaps the workers, and a fresh folder for their logs and metrics."""
    ok, reason = available()
    if not ok:
        print(f"error: the namespace network is not available here: {reason}", file=sys.stderr)
        return None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERMed driver still reaps its workers
    root = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"logs and metrics: {root}", flush=True)
    return root


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny, the 1 Gbit/s + 100 ms link, 10-s rounds, 2 measured rounds")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--links", default=",".join(LINKS),
                        help=f"comma-separated, of {tuple(LINKS)} or RATEmbit-RTTms")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"comma-separated, of {SYSTEMS} and the --variant names")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="a system of peers run with these extra flags, e.g. f4='--fragments 4 --overlap'")
    parser.add_argument("--round-seconds", type=float, default=30.0, help="compute per round (an epoch for hivemind)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds measured per worker, after the first")
    parser.add_argument("--min-step-seconds", type=float, default=0.0,
                        help=f"pad every step to this long (default per preset: {PACE})")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step per worker")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--grace-seconds", type=float, default=5.0,
                        help="the peers' matchmaking window, and hivemind's matchmaking_time")
    parser.add_argument("--eval-every", type=int, default=10**6,
                        help="the peers' held-out evaluation interval (default: never, see the notes)")
    parser.add_argument("--checkpoints", action="store_true", help="peers also checkpoint every round")
    parser.add_argument("--notsent-lowat", type=int, default=0, metavar="BYTES",
                        help="each worker's host bounds a socket's unsent bytes to this (net.ipv4.tcp_notsent_lowat; "
                             "0: the kernel's default, no bound)")
    parser.add_argument("--join-late", action="store_true",
                        help="the last worker starts once every other has finished its first round: a volunteer "
                             "joining a swarm mid-run")
    parser.add_argument("--out", type=Path, help="also write the table, with how it was measured, here")
    parser.add_argument("peer_args", nargs="*", help="extra flags for every peer (after --)")
    args = parser.parse_args(argv)
    args.commit = head_commit()  # the peers run the working tree: note when it moves during the run
    if args.quick:
        args.presets, args.links, args.round_seconds, args.rounds = "tiny", "1gbit-100ms", 10.0, 2
    args.variants = dict(v.split("=", 1) for v in args.variant if "=" in v)
    args.presets, links, systems = args.presets.split(","), args.links.split(","), args.systems.split(",")
    if any(link_named(name) is None for name in links) or set(systems) - set(SYSTEMS) - set(args.variants):
        parser.error(f"--links takes some of {tuple(LINKS)} or RATEmbit-RTTms, --systems some of {SYSTEMS} and "
                     f"the --variant names")
    root = start_driver("wan_")
    if root is None:
        return 1
    results, began = [], time.monotonic()
    for preset in args.presets:
        for name in links:
            link = link_named(name)
            with TestNetwork(args.peers, rate_mbit=link.rate_mbit, delay_ms=link.delay_ms,
                             notsent_lowat=args.notsent_lowat or None) as net:
                for system in systems:
                    result = run_system(system, preset, link, net, args, root / preset / name / system)
                    results.append(result)
                    print(progress_line(result), flush=True)
    minutes = (time.monotonic() - began) / 60
    report = f"{table(results)}\n\n{notes(results)}\n\nThe whole run took {minutes:.0f} minutes.\n"
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header(argv, args) + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
