"""Held-out loss per wall-second: this project's peers, hivemind.Optimizer and synchronous data-parallel, side by side.

    python -m bench.head_to_head --out bench/results/head_to_head.md --plot bench/results/head_to_head.png
    python -m bench.head_to_head --quick        # a smoke run: tiny, unlimited link, 4 rounds a system

For every model preset and link, one namespace network (``docker.netns.TestNetwork``: a namespace per worker,
tbf for the rate, the user-space forwarder for the delay) carries three systems in turn, 4 fresh workers each,
on the same model, data, batch, inner AdamW schedule and step pacing (``--min-step-seconds``: a slower device,
so that 4 workers share a small machine at a fixed pace):

- ``diloco``: ``python -m peer`` with the project's defaults, H = ``--inner-steps``;
- ``hivemind``: ``bench.hivemind_worker``, hivemind.Optimizer with local updates (OpenDiLoCo's baseline,
  plain parameter averaging every epoch of 4 x H steps' samples, in the background);
- ``dp``: ``bench.sync_worker``, torch.distributed (gloo over the same links) data-parallel: the gradients
  all-reduced every step.

The peers run until they have taken ``--rounds`` outer steps; the other two then run for as long
(``--wall-factor`` times the peers' wall time), so that all three are compared at equal wall time.
Every worker evaluates on the peers' held-out batches every ``--eval-every`` rounds (the peers the global
parameters; each hivemind worker its own replica, and their mean is reported; data-parallel's rank 0, whose
weights every rank shares). Wall time counts from the workers' launch, startup included for all three. Bytes
are each worker's wire bytes through its namespace's link (``bench.wan.LinkMeter``: all traffic, TCP/IP
headers included).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from bench.wan import LINKS, Link, LinkMeter, head_commit, start_driver, tail
from docker.netns import TestNetwork
from tests.harness.swarm import PeerProc, Proc, Swarm, read_metrics

SYSTEMS = ("diloco", "hivemind", "dp")
PACE = {"tiny": 1.0, "small": 2.0}  # default --min-step-seconds: above a step's compute with 4 workers here
DP_PORT = 29500


@dataclass
class Curve:
    """One system's run: held-out eval loss at (wall seconds since launch, tokens), and its bytes."""

    system: str
    points: List[Tuple[float, int, float]] = field(default_factory=list)  # (seconds, tokens, eval loss)
    rounds: int = 0
    seconds: float = 0.0
    sent: float = 0.0  # bytes per worker over the run
    problems: List[str] = field(default_factory=list)

    def at(self, seconds: float) -> Optional[float]:
        """Eval loss at ``seconds``: the last evaluation by then (what a user holding this model had)."""
        before = [loss for t, _, loss in self.points if t <= seconds]
        return before[-1] if before else None


# ---------------------------------------------------------------- workers
def shared_flags(args, preset: str) -> Dict[str, str]:
    """What all three systems share: model, batch, schedule, pacing."""
    return {"--model": preset, "--batch-size": str(args.batch_size), "--seq-len": str(args.seq_len),
            "--warmup-steps": str(args.inner_steps), "--min-step-seconds": str(pace_of(args, preset)),
            "--threads": "1", "--eval-batches": str(args.eval_batches), "--seed": str(args.seed)}


def pace_of(args, preset: str) -> float:
    return args.min_step_seconds or PACE.get(preset, 2.0)


def flat(flags: Dict[str, str]) -> List[str]:
    return [part for pair in flags.items() for part in pair]


def worker_argv(system: str, i: int, preset: str, swarm: Swarm, net: TestNetwork, args, metrics: Path) -> List[str]:
    shared, host = shared_flags(args, preset), f"/ip4/{net.ip(i)}/tcp/0"
    if system == "diloco":
        return [*flat(shared), "--inner-steps", str(args.inner_steps), "--eval-every", str(args.eval_every),
                "--grace-seconds", str(args.grace_seconds), "--run-id", f"h2h-{preset}", "--quiet",
                "--host-maddrs", host, "--initial-peers", swarm.maddr, "--new-run", *args.peer_args]
    if system == "hivemind":
        target = args.peers * args.batch_size * args.inner_steps
        return [sys.executable, "-m", "bench.hivemind_worker", *flat(shared), "--initial-peers", swarm.maddr,
                "--host-maddrs", host, "--run-id", f"h2h-hm-{preset}", "--target-batch-size", str(target),
                "--matchmaking-time", str(args.grace_seconds), "--shard", str(i), "--eval-every",
                str(args.eval_every), "--metrics-file", str(metrics)]
    return ["env", "GLOO_SOCKET_IFNAME=eth0", sys.executable, "-m", "bench.sync_worker", *flat(shared),
            "--master", net.ip(0), "--port", str(DP_PORT), "--rank", str(i), "--world-size", str(args.peers),
            "--inner-steps", str(args.inner_steps), "--eval-every", str(args.eval_every), "--metrics-file",
            str(metrics)]


def start_workers(system: str, preset: str, swarm: Swarm, net: TestNetwork, args, log_dir: Path) -> List[Proc]:
    workers = []
    for i in range(args.peers):
        metrics = log_dir / f"w{i}.jsonl"
        argv, wrap = worker_argv(system, i, preset, swarm, net, args, metrics), (lambda i: lambda a: net.wrap(i, a))(i)
        if system == "diloco":
            proc = PeerProc(argv, log_dir, f"w{i}", wrap, metrics_path=metrics)
        else:
            proc = Proc(argv, log_dir, f"w{i}", wrap)
            proc.metrics_path = metrics
        swarm.track(proc)
        workers.append(proc)
    return workers


def rounds_done(system: str, records: List[List[dict]]) -> int:
    """Outer steps every worker has finished (data-parallel: rank 0's rounds)."""
    if system == "dp":
        return max((r["epoch"] for r in records[0]), default=0)
    return min((max((r["epoch"] for r in rows), default=0) for rows in records), default=0)


def run_system(system: str, preset: str, net: TestNetwork, args, log_dir: Path, budget: Optional[float]) -> Curve:
    """Start 4 workers and let them train for ``budget`` seconds, or (None) ``--rounds`` outer steps, then stop
    them."""
    log_dir.mkdir(parents=True)
    swarm, meter, curve = Swarm(log_dir, net), LinkMeter(net), Curve(system)
    launched = time.time()
    try:
        workers = start_workers(system, preset, swarm, net, args, log_dir)
        looked = 0.0
        while True:
            meter.sample()
            time.sleep(0.1)
            if time.monotonic() - looked < 0.5:
                continue
            looked = time.monotonic()
            records = [read_metrics(w.metrics_path) for w in workers]
            curve.rounds = rounds_done(system, records)
            dead = [f"{w.name} exited (rc={w.popen.returncode}): {tail(w.stderr)}" for w in workers if not w.alive()]
            done = curve.rounds >= args.rounds if budget is None else time.time() - launched > budget
            if done or dead:
                curve.problems += dead
                break
    finally:
        swarm.close()
    curve.seconds = time.time() - launched
    records = [read_metrics(w.metrics_path) for w in workers]
    curve.points = evaluations(system, records, launched)
    if system == "hivemind":
        curve.problems += alone({w.name: rows for w, rows in zip(workers, records)})
    sent = [meter.at(i, time.time())[0] - meter.at(i, launched)[0] for i in range(args.peers)]
    curve.sent = statistics.mean(sent)
    return curve


def alone(records: Dict[str, List[dict]]) -> List[str]:
    """hivemind workers that never saw another in its progress records: their "averaged" replica trained alone,
    and the row says so (every worker did, unseen, while a validator rejected every record: fixed by f790964)."""
    return [f"{name} never saw another worker: its replica trained alone" for name, rows in records.items()
            if max((r.get("peers_seen") or 0 for r in rows), default=0) < 2]


def evaluations(system: str, records: List[List[dict]], launched: float) -> List[Tuple[float, int, float]]:
    """(seconds since launch, tokens, eval loss) per evaluated epoch: the first worker to report it (the peers and
    data-parallel hold one model), or for hivemind the mean of its workers' replicas, at the last one's time."""
    by_epoch: Dict[int, List[dict]] = {}
    for rows in records:
        for r in rows:
            if r.get("eval_loss") is not None and (system != "diloco" or r.get("applied")):
                by_epoch.setdefault(r["epoch"], []).append(r)
    points = []
    for epoch, rows in sorted(by_epoch.items()):
        if system == "hivemind":
            points.append((max(r["time"] for r in rows) - launched, rows[0]["tokens_total"],
                           statistics.mean(r["eval_loss"] for r in rows)))
        else:
            first = min(rows, key=lambda r: r["time"])
            points.append((first["time"] - launched, first["tokens_total"], first["eval_loss"]))
    return points


# ---------------------------------------------------------------- report
def compare(curves: Dict[str, Curve], args) -> List[str]:
    """The issue's goals at equal wall time: at each of the peers' evaluations after the first two rounds, against
    what the others held by then; and at the end (the peers' last evaluation)."""
    ours, lines = curves.get("diloco"), []
    if ours is None or not ours.points:
        return ["- the peers made no evaluation: nothing to compare"]
    late = [(t, loss) for t, tokens, loss in ours.points if tokens > 2 * args.peers * args.batch_size
            * args.inner_steps * args.seq_len]
    end_t, end_loss = ours.points[-1][0], ours.points[-1][2]
    for name in ("hivemind", "dp"):
        other = curves.get(name)
        if other is None or not other.points:
            continue
        pairs = [(t, loss, other.at(t)) for t, loss in late if other.at(t) is not None]
        behind = [f"{t:.0f} s: {loss:.4f} vs {theirs:.4f}" for t, loss, theirs in pairs if loss > theirs]
        theirs = other.at(end_t)
        gap = f"{(end_loss / theirs - 1) * 100:+.2f}%" if theirs else "n/a"
        lines.append(f"- against {name}: at {len(pairs) - len(behind)} of {len(pairs)} of the peers' evaluations after "
                     f"round 2 the peers' eval loss is at or below {name}'s at the same wall time"
                     + (f" (behind at {'; '.join(behind)})" if behind else "")
                     + f"; at the end ({end_t:.0f} s) {end_loss:.4f} vs {theirs if theirs is None else f'{theirs:.4f}'}"
                     f": {gap}")
    return lines


def table(preset: str, link: Link, curves: Dict[str, Curve]) -> str:
    lines = [f"### {preset}, {link.describe()}", "",
             "| system | outer steps | wall s | tokens | eval loss (last) | MB sent per worker | evaluations "
             "(s: loss) |", "|---|---|---|---|---|---|---|"]
    for name, c in curves.items():
        last = c.points[-1] if c.points else (0.0, 0, float("nan"))
        trace = ", ".join(f"{t:.0f}: {loss:.3f}" for t, _, loss in c.points)
        problems = f" ({'; '.join(c.problems)})" if c.problems else ""
        lines.append(f"| {name}{problems} | {c.rounds} | {c.seconds:.0f} | {last[1]:,} | {last[2]:.4f} | "
                     f"{c.sent / 1e6:.1f} | {trace} |")
    return "\n".join(lines)


def plot(results: List[Tuple[str, Link, Dict[str, Curve]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 8), squeeze=False)
    for column, (preset, link, curves) in enumerate(results):
        for row, (axis, label) in enumerate(((0, "wall seconds since launch"), (1, "tokens, all workers"))):
            ax = axes[row][column]
            for name, c in curves.items():
                ax.plot([p[axis] for p in c.points], [p[2] for p in c.points], marker=".", label=name)
            ax.set(title=f"{preset}, {link.describe()}", xlabel=label, ylabel="held-out eval loss")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def header(argv: List[str], args) -> str:
    command = shlex.join(["python", "-m", "bench.head_to_head", *argv])
    paces = ", ".join(f"{p} {pace_of(args, p):g} s" for p in args.presets)
    return (f"# Head to head: held-out loss per wall-second against hivemind.Optimizer and data-parallel\n\n"
            f"Command (as root, {os.cpu_count()} CPU threads, one namespace per worker):\n\n    {command}\n\n"
            f"Measured {datetime.date.today().isoformat()} at commit {head_commit()}, torch "
            f"{version('torch').split('+')[0]} CPU, hivemind {version('hivemind')}: {args.peers} workers a system, "
            f"H = {args.inner_steps} steps of {args.batch_size} x {args.seq_len} tokens, paced to {paces}, "
            f"evaluation every {args.eval_every} rounds on {args.eval_batches} held-out batches, seed {args.seed}.\n\n")


# ---------------------------------------------------------------- main
def parse_args(argv: List[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny, unlimited link, 4 rounds")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--presets", default="tiny,small", help="comma-separated model presets")
    parser.add_argument("--links", default="unlimited,100mbit-100ms", help=f"comma-separated, of {tuple(LINKS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {SYSTEMS}")
    parser.add_argument("--rounds", type=int, default=32, help="outer steps a system runs for")
    parser.add_argument("--wall-factor", type=float, default=1.0,
                        help="the others run for this many times the peers' wall time")
    parser.add_argument("--inner-steps", type=int, default=10, help="H; hivemind's epoch is 4 x H steps' samples")
    parser.add_argument("--min-step-seconds", type=float, default=0.0, help=f"step pacing (default: {PACE})")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grace-seconds", type=float, default=5.0)
    parser.add_argument("--eval-every", type=int, default=2, help="rounds between evaluations")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("peer_args", nargs="*", help="extra flags for every peer (after --)")
    args = parser.parse_args(argv)
    if args.quick:
        args.presets, args.links, args.rounds = "tiny", "unlimited", 4
    args.presets, args.links, args.systems = args.presets.split(","), args.links.split(","), args.systems.split(",")
    if set(args.links) - set(LINKS) or set(args.systems) - set(SYSTEMS):
        parser.error(f"--links takes some of {tuple(LINKS)}, --systems some of {SYSTEMS}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    root = start_driver("h2h_")
    if root is None:
        return 1
    results, sections, began = [], [], time.monotonic()
    for preset in args.presets:
        for name in args.links:
            link, curves = LINKS[name], {}
            with TestNetwork(args.peers, rate_mbit=link.rate_mbit, delay_ms=link.delay_ms) as net:
                for system in args.systems:
                    budget = args.wall_factor * curves["diloco"].seconds if "diloco" in curves else None
                    curves[system] = run_system(system, preset, net, args, root / preset / name / system, budget)
                    print(f"{preset}, {name}, {system}: {curves[system].rounds} rounds, "
                          f"{curves[system].seconds:.0f} s, evaluations {curves[system].points}", flush=True)
            results.append((preset, link, curves))
            sections.append(table(preset, link, curves) + "\n\n" + "\n".join(compare(curves, args)))
    report = "\n\n".join(sections) + f"\n\nThe whole run took {(time.monotonic() - began) / 60:.0f} minutes.\n"
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(header(argv, args) + report)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
