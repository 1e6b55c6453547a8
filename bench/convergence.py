"""Convergence: DiLoCo as the swarm runs it against synchronous data-parallel training, on held-out text.

    python -m bench.convergence --out bench/results/convergence.md --plot bench/results/convergence.png
    python -m bench.convergence --quick                   # a small sweep for CI, well under a minute
    python -m bench.convergence --multi-peer --out bench/results/convergence.md

The sweep simulates M replicas in one process (bench/simulation.py: the peer's own inner loop, codecs,
error feedback, token weighting, robust mean, outer Nesterov step and momentum alignment) and varies one
axis at a time around the centre (M=4, H=100, int4, momentum alignment and error feedback on): M, H,
codec, alignment, error feedback, one replica 3x slower; and, to show where a gap comes from, the outer
learning rate and plain averaging (outer lr 1, no momentum). Every cell gets
the same token budget and is run for each seed; its baseline is synchronous data-parallel training of
the same model on the same M data streams, the gradients averaged every step, for the same tokens and
optimizer steps. Reported per cell: held-out eval loss (mean over seeds), its gap to data-parallel,
encoded bytes sent per replica, and data-parallel's bytes (the fp32 gradient every step) over those.

The model is a 0.16M-parameter Llama (hidden 64, 2 layers, byte vocabulary), the product's
preset ``micro``: a CPU sweep of 36 runs fits in about an hour of one core only at this size.

``--multi-peer`` is the check that the simulation measures the product: a bootstrap ``python -m dht`` and
3 real ``python -m peer`` processes on loopback train the tiny preset for 20 rounds; their final held-out
eval loss is compared with ``simulate()`` of the same configuration at 2 seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from diloco_compression import get_codec

from bench.simulation import SimulationResult, data_parallel, round_steps, simulate
from peer.config import RunConfig, SyncConfig
from peer.presets import PRESETS
from peer.train.model import build_model, count_parameters

MODEL = "micro"
AXES = ("M", "H", "codec", "alignment", "feedback", "slow", "outer-lr", "outer-lr-decay", "averaging", "warm-start",
        "outer-warmup", "outer-momentum", "fragments")
OPT_IN = ("outer-lr-decay", "outer-momentum")  # axes a sweep runs only when asked
SLOWDOWN = 3.0  # the slow replica's seconds per inner step, relative to the others
QUICK = dict(tokens=80_000, replicas=2, inner_steps=10, seeds=[0], axes=["codec", "alignment", "feedback"],
             codecs=["none"], eval_batches=4, evals=4, warmup_steps=20)
SECTION = "<!-- convergence:{name} -->"
SECTION_END = "<!-- /convergence:{name} -->"


@dataclass(frozen=True)
class Cell:
    """One DiLoCo configuration of the sweep."""

    axis: str  # what differs from the centre ("centre" for the centre itself)
    replicas: int
    inner_steps: int
    compression: str
    align: bool
    feedback: bool
    slow: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_lr_decay: bool = False  # the outer lr follows the inner cosine
    warm: float = 0.0  # fraction of the tokens trained data-parallel before DiLoCo starts
    outer_warmup: int = 0  # outer steps blending from plain averaging to Nesterov (the product's default: 100/√H)
    fragments: int = 1  # streaming fragments: a round of H/F steps averages one of F fragments (equal bytes per H)

    @property
    def label(self) -> str:
        return {"centre": "centre", "M": f"M={self.replicas}", "H": f"H={self.inner_steps}",
                "codec": f"codec {self.compression}", "alignment": f"alignment {'on' if self.align else 'off'}",
                "feedback": f"error feedback {'on' if self.feedback else 'off'}",
                "slow": f"one replica {SLOWDOWN:g}x slower", "outer-lr": f"outer lr {self.outer_lr:g}",
                "outer-lr-decay": f"outer lr {self.outer_lr:g}, decaying with the inner lr",
                "averaging": "plain averaging (outer lr 1, momentum 0)",
                "warm-start": f"data-parallel for the first {self.warm:.0%} of the tokens" + (
                    f", then an outer warm-up over {self.outer_warmup} steps" if self.outer_warmup else ""),
                "outer-warmup": f"outer warm-up over {self.outer_warmup} steps, from plain averaging to "
                                f"Nesterov lr {self.outer_lr:g}",
                "outer-momentum": f"outer momentum {self.outer_momentum:g}" + (
                    f", after a warm-up over {self.outer_warmup} steps" if self.outer_warmup else ""),
                "fragments": f"{self.fragments} fragments, one averaged every {self.inner_steps // self.fragments} "
                             f"steps"}[self.axis]

    def paces(self) -> List[float]:
        return [1.0] * (self.replicas - 1) + [SLOWDOWN if self.slow else 1.0]


def cells(args) -> List[Cell]:
    """The centre, then one axis at a time."""
    centre = Cell("centre", args.replicas, args.inner_steps, args.compression, True, True)
    varied = {
        "M": [dataclasses.replace(centre, axis="M", replicas=m) for m in args.sweep_replicas],
        "H": [dataclasses.replace(centre, axis="H", inner_steps=h) for h in args.sweep_inner_steps],
        "codec": [dataclasses.replace(centre, axis="codec", compression=c) for c in args.codecs],
        "alignment": [dataclasses.replace(centre, axis="alignment", align=False)],
        "feedback": [dataclasses.replace(centre, axis="feedback", feedback=False)],
        "slow": [dataclasses.replace(centre, axis="slow", slow=True)],
        "outer-lr": [dataclasses.replace(centre, axis="outer-lr", outer_lr=lr) for lr in args.outer_lrs],
        "outer-lr-decay": [dataclasses.replace(centre, axis="outer-lr-decay", outer_lr=lr, outer_lr_decay=True)
                           for lr in args.decayed_outer_lrs],
        "averaging": [dataclasses.replace(centre, axis="averaging", outer_lr=1.0, outer_momentum=0.0)],
        "warm-start": [dataclasses.replace(centre, axis="warm-start", warm=warm, outer_warmup=steps)
                       for warm in args.warm_starts for steps in args.warm_start_outer_warmups],
        "outer-warmup": [dataclasses.replace(centre, axis="outer-warmup", outer_warmup=steps, outer_lr=lr)
                         for steps in args.outer_warmups for lr in args.warmed_outer_lrs],
        "outer-momentum": [dataclasses.replace(centre, axis="outer-momentum", outer_momentum=momentum,
                                               outer_warmup=steps)
                           for momentum in args.outer_momenta for steps in args.momentum_warmups],
        "fragments": [dataclasses.replace(centre, axis="fragments", fragments=count) for count in args.fragment_counts],
    }
    same = dataclasses.replace(centre, axis="")
    return [centre] + [cell for axis in args.axes for cell in varied[axis]
                       if dataclasses.replace(cell, axis="") != same]


def base_run(args, **settings) -> RunConfig:
    # the sweep's centre keeps DiLoCo's outer schedule, Nesterov from the first step (``Cell.outer_warmup``); so do
    # the settings of the baselines, which no outer step reads (the cache's keys of earlier runs stay valid)
    settings.setdefault("outer_warmup", 0)
    return RunConfig(model=MODEL, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=args.warmup_steps, eval_batches=args.eval_batches, **settings)


def warm_steps(cell: Cell, args) -> int:
    return round(cell.warm * args.tokens / (cell.replicas * args.batch_size * args.seq_len))


def cell_rounds(cell: Cell, args) -> int:
    """Rounds that spend the token budget (a slow replica's rounds hold fewer tokens, so it gets more)."""
    per_round = sum(round_steps(cell.inner_steps // cell.fragments, cell.paces())) * args.batch_size * args.seq_len
    return max(1, round((1 - cell.warm) * args.tokens / per_round))


def cell_run(cell: Cell, args) -> RunConfig:
    # the cosine spans the whole run
    steps = warm_steps(cell, args) + cell_rounds(cell, args) * (cell.inner_steps // cell.fragments)
    return base_run(args, inner_steps=cell.inner_steps, lr_decay_steps=steps,
                    compression=cell.compression, error_feedback=cell.feedback,
                    align_every=args.align_every if cell.align else 0, outer_lr=cell.outer_lr,
                    outer_momentum=cell.outer_momentum, outer_lr_decay=cell.outer_lr_decay,
                    outer_warmup=cell.outer_warmup, fragments=cell.fragments)


def dp_steps(replicas: int, args) -> int:
    return max(1, round(args.tokens / (replicas * args.batch_size * args.seq_len)))


def dp_eval_every(replicas: int, args) -> int:
    """Data-parallel evaluates where DiLoCo with H = the centre's and this M does (a round of H steps on each
    replica holds as many tokens as H data-parallel steps), so their gap needs no interpolation."""
    cell = Cell("M", replicas, args.inner_steps, args.compression, True, True)
    return args.inner_steps * max(1, cell_rounds(cell, args) // args.evals)


class Runs:
    """Each simulation the report needs, run once; with a cache file, kept there so that a rerun resumes."""

    def __init__(self, path: Optional[Path]):
        self.path = path
        self.done: Dict[str, dict] = json.loads(path.read_text()) if path and path.exists() else {}
        self.seconds = [0.0, 0.0]  # wall-clock and CPU seconds the runs used took when they ran
        self.used = 0

    def _get(self, key: dict, compute) -> SimulationResult:
        text = json.dumps(key, sort_keys=True)
        if text not in self.done:
            start, cpu = time.perf_counter(), time.process_time()
            entry = dataclasses.asdict(compute())
            entry.update(wall_seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
            self.done[text] = entry
            print(f"{key['kind']} {key.get('label', '')} M={key['replicas']} seed={key['seed']}: "
                  f"eval {entry['eval_losses'][-1]:.4f} ({entry['wall_seconds']:.0f}s wall, "
                  f"{entry['cpu_seconds']:.0f}s cpu)", flush=True)
            if self.path:
                self.path.write_text(json.dumps(self.done))
        entry, self.used = dict(self.done[text]), self.used + 1
        self.seconds[0] += entry.pop("wall_seconds", float("nan"))
        self.seconds[1] += entry.pop("cpu_seconds", float("nan"))
        return SimulationResult(**entry)

    def diloco(self, cell: Cell, args, seed: int) -> SimulationResult:
        run, rounds = cell_run(cell, args), cell_rounds(cell, args)
        every = max(1, rounds // args.evals)
        key = dict(kind="diloco", label=cell.label, settings=run.to_settings(), replicas=cell.replicas,
                   rounds=rounds, paces=cell.paces(), seed=seed, eval_every=every)
        warm = warm_steps(cell, args)
        if warm:
            key.update(warm_steps=warm)
        return self._get(key, lambda: simulate(run, cell.replicas, rounds, every, seed, cell.paces(), warm_steps=warm))

    def data_parallel(self, replicas: int, args, seed: int, steps: int, every: int) -> SimulationResult:
        run = base_run(args, lr_decay_steps=steps)
        key = dict(kind="data-parallel", settings=run.to_settings(), replicas=replicas, steps=steps, seed=seed,
                   eval_every=every)
        return self._get(key, lambda: data_parallel(run, replicas, steps, every, seed))


@dataclass
class Row:
    label: str
    cell: Optional[Cell]  # None: data-parallel
    replicas: int
    results: List[SimulationResult]  # one per seed
    baseline: List[SimulationResult]  # data-parallel with the same M, per seed

    @property
    def loss(self) -> float:
        return statistics.mean(r.eval_losses[-1] for r in self.results)

    @property
    def gap(self) -> float:
        """Eval-loss gap in % of the mean over seeds to data-parallel's (mean) at the same tokens: rounds of H
        steps need not end exactly at data-parallel's last step (past it, data-parallel's last evaluation)."""
        return float(self.gap_curve()[1][-1])

    @property
    def bytes_sent(self) -> float:
        return statistics.mean(r.bytes_sent[-1] for r in self.results)

    @property
    def tokens(self) -> int:
        return self.results[0].tokens[-1]

    @property
    def ratio(self) -> float:
        """Data-parallel's bytes for as many tokens as this row trained on (it sends a gradient every step), over
        this row's bytes."""
        baseline = self.baseline[0]
        return baseline.bytes_sent[-1] * self.tokens / baseline.tokens[-1] / self.bytes_sent

    @property
    def equivalent(self) -> float:
        """The fraction of its tokens after which data-parallel (seed means) first reached this row's loss."""
        tokens, loss = Row("", None, self.replicas, self.baseline, self.baseline).curve()
        tokens = np.concatenate([[0], tokens])
        loss = np.minimum.accumulate(np.concatenate([[statistics.mean(r.initial_loss for r in self.baseline)], loss]))
        return float(np.interp(-self.loss, -loss, tokens)) / tokens[-1]

    def curve(self):
        """(tokens, eval loss mean over seeds): every seed evaluates at the same token counts."""
        return np.array(self.results[0].tokens), np.mean([r.eval_losses for r in self.results], axis=0)

    def gap_curve(self):
        """(tokens, gap in % to data-parallel interpolated at those tokens)."""
        tokens, loss = self.curve()
        base = Row("", None, self.replicas, self.baseline, self.baseline).curve()
        return tokens, 100 * (loss / np.interp(tokens, *base) - 1)


def run_sweep(args, runs: Runs) -> List[Row]:
    sweep = cells(args)
    baselines = {m: [runs.data_parallel(m, args, seed, dp_steps(m, args), dp_eval_every(m, args))
                     for seed in args.seeds] for m in sorted({cell.replicas for cell in sweep})}
    rows = [Row(f"data-parallel M={m}", None, m, results, results) for m, results in baselines.items()]
    for cell in sweep:
        results = [runs.diloco(cell, args, seed) for seed in args.seeds]
        rows.append(Row(cell.label, cell, cell.replicas, results, baselines[cell.replicas]))
    return rows


def lone_replica(runs: Runs, args) -> List[SimulationResult]:
    """One replica alone for as many steps as each of the centre's replicas takes (1/M of the tokens): what
    DiLoCo's averaging of M such replicas adds."""
    steps, every = dp_steps(args.replicas, args), dp_eval_every(args.replicas, args)
    return [runs.data_parallel(1, args, seed, steps, every) for seed in args.seeds]


def fmt_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def table(rows: List[Row], args) -> str:
    seeds = " / ".join(f"seed {seed}" for seed in args.seeds)
    lines = [f"| cell | M | H | codec | alignment | error feedback | rounds (steps) | eval loss ({seeds}) | mean | "
             f"gap to data-parallel | data-parallel had this loss after | bytes sent per replica | "
             f"data-parallel's bytes / these |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cell, per_seed = row.cell, " / ".join(f"{r.eval_losses[-1]:.4f}" for r in row.results)
        if cell is None:
            settings = f"{row.replicas} | every step | fp32 | - | - | ({row.results[0].eval_rounds[-1]})"
        else:
            aligned = f"every {args.align_every}" if cell.align and args.align_every else "off"
            settings = (f"{cell.replicas} | {cell.inner_steps} | {cell.compression} | {aligned} | "
                        f"{'on' if cell.feedback else 'off'} | {row.results[0].eval_rounds[-1]}")
        lines.append(f"| {row.label} | {settings} | {per_seed} | {row.loss:.4f} | {row.gap:+.2f}% | "
                     f"{row.equivalent:.0%} of the tokens | {fmt_bytes(row.bytes_sent)} | {row.ratio:,.0f}x |")
    return "\n".join(lines)


def find(rows: List[Row], label: str) -> Optional[Row]:
    return next((row for row in rows if row.label == label), None)


def goal(rows: List[Row], args) -> str:
    centre = find(rows, "centre")
    codec = get_codec(args.compression)
    if not codec.fixed_size:
        how = (f"Measured: {args.inner_steps * 32 / centre.ratio:.2f} bits a value a round, all sends included "
               f"({args.compression}'s size depends on the values it codes).")
    else:
        bits = 8 * codec.wire_bytes(1 << 20) / (1 << 20)
        k = args.align_every  # 0: the first moment never travels
        ceiling = args.inner_steps * 32 / bits / (1 + (1 / k if k else 0))
        moment, term = (f", plus its encoded first moment every {k} rounds", f" / (1 + 1/{k})") if k else ("", "")
        how = (f"By construction: a replica sends one encoded pseudo-gradient every H={args.inner_steps} steps, "
               f"{args.compression} at {bits:.2f} bits a value{moment}, where data-parallel sends 32 bits a value "
               f"every step: {args.inner_steps} x 32 / {bits:.2f}{term} = {ceiling:,.0f}x, whatever the "
               f"model. Both all-reduces move 2(M-1)/M of these bytes per replica, which cancels.")
    return "\n".join([
        f"- Eval-loss gap of the centre to data-parallel: **{centre.gap:+.2f}%** (goal: at most +1%: "
        f"**{'met' if centre.gap <= 1 else 'not met'}**).",
        f"- Bytes: data-parallel sends **{centre.ratio:,.0f}x** the centre's (goal: at least 1000x: "
        f"**{'met' if centre.ratio >= 1000 else 'not met'}**). {how}",
        *entropy_coded(rows, centre),
    ])


def entropy_coded(rows: List[Row], centre: Row) -> List[str]:
    """The goal's line for the centre with int4-huffman, whose bytes depend on the values, so are measured."""
    row = find(rows, "codec int4-huffman")
    if row is None or centre.cell.compression != "int4":
        return []
    per_seed = [100 * (r.eval_losses[-1] / c.eval_losses[-1] - 1) for r, c in zip(row.results, centre.results)]
    bits = row.cell.inner_steps * 32 / row.ratio  # data-parallel's 32 bits a value a step, over the ratio
    return [f"- The centre with `int4-huffman` instead (4-bit integers too, a uniform grid in blocks of "
            f"{get_codec('int4-huffman').block}, "
            f"their codes Huffman-coded): data-parallel sends **{row.ratio:,.0f}x** its bytes (goal: "
            f"**{'met' if row.ratio >= 1000 else 'not met'}**), measured, not by construction: {bits:.2f} bits a "
            f"value a round, all sends included. Eval-loss gap **{row.gap:+.2f}%**; its eval loss differs by "
            f"{', '.join(f'{d:+.2f}%' for d in per_seed)} from the centre's, per seed."]


def gap_over_training(rows: List[Row]) -> str:
    """The centre's gap at each of its evaluations, and every cell's gap at its end."""
    centre = find(rows, "centre")
    tokens, gaps = centre.gap_curve()
    loss = centre.curve()[1]
    lines = ["| tokens | centre's round | centre eval loss | gap to data-parallel |", "|---|---|---|---|"]
    for index, (count, gap) in enumerate(zip(tokens, gaps)):
        lines.append(f"| {count / 1e6:.2f}M | {centre.results[0].eval_rounds[index]} | {loss[index]:.4f} | "
                     f"{gap:+.2f}% |")
    return "\n".join(lines)


def gap_sources(rows: List[Row], lone: List[SimulationResult], args) -> str:
    """The cells that show where the centre's gap comes from, by axis, and a lone replica for reference."""
    centre, lines = find(rows, "centre"), []
    for axis, what in (("H", "rounds (H)"), ("M", "replicas (M)"), ("outer-lr", "outer learning rate"),
                       ("outer-lr-decay", "outer learning rate, decaying"),
                       ("averaging", "outer optimizer"), ("warm-start", "warm start")):
        shown = sorted([centre] + [row for row in rows if row.cell is not None and row.cell.axis == axis],
                       key=lambda row: (row.cell.inner_steps, row.cell.replicas, row.cell.outer_lr, row.cell.warm))
        if len(shown) > 1:
            lines.append(f"- {what}: " + "; ".join(
                f"{row.label} ({row.results[0].eval_rounds[-1]} rounds) {row.gap:+.2f}%" for row in shown) + ".")
    losses = [r.eval_losses[-1] for r in lone]
    dp = find(rows, f"data-parallel M={centre.replicas}")
    lines.append(f"- One replica alone for as many steps ({lone[0].eval_rounds[-1]}) of {args.batch_size} x "
                 f"{args.seq_len} tokens as each of the centre's replicas (1/{centre.replicas} of the tokens, no "
                 f"communication): eval loss {statistics.mean(losses):.4f} ({' / '.join(f'{x:.4f}' for x in losses)});"
                 f" the centre's {centre.replicas} such replicas, averaged every {centre.cell.inner_steps} steps: "
                 f"{centre.loss:.4f}; data-parallel: {dp.loss:.4f}.")
    return "\n".join(lines)


def effects(rows: List[Row]) -> str:
    """What turning alignment or error feedback off changes, measured against the centre, seed by seed."""
    centre, lines = find(rows, "centre"), []
    for label, what in (("alignment off", "momentum alignment"), ("error feedback off", "error feedback")):
        row = find(rows, label)
        if row is None:
            continue
        per_seed = [100 * (r.eval_losses[-1] / c.eval_losses[-1] - 1) for r, c in zip(row.results, centre.results)]
        lines.append(f"- Without {what}: eval loss {row.loss:.4f} against {centre.loss:.4f} "
                     f"({', '.join(f'{d:+.2f}%' for d in per_seed)} per seed), bytes "
                     f"{fmt_bytes(row.bytes_sent)} against {fmt_bytes(centre.bytes_sent)}.")
    return "\n".join(lines)


def plot(rows: List[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centre = find(rows, "centre")
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    dp = find(rows, f"data-parallel M={centre.replicas}")
    left.plot(*dp.curve(), "k-", lw=2, label=dp.label)
    shown = [centre] + [row for row in rows if row.cell is not None and row.cell.axis == "H"]
    for row in sorted(shown, key=lambda r: r.cell.inner_steps):
        style = dict(lw=2.5) if row is centre else dict(lw=1, alpha=0.8)
        left.plot(*row.curve(), marker=".", label=f"DiLoCo {row.label}, H={row.cell.inner_steps}"
                  if row is centre else f"DiLoCo {row.label}", **style)
        right.plot(*row.gap_curve(), marker=".", label=left.get_lines()[-1].get_label(), **style)
    for row in rows:
        if row.cell is not None and row.cell.axis in ("alignment", "feedback", "slow", "outer-lr", "outer-lr-decay",
                                                      "averaging", "warm-start"):
            right.plot(*row.gap_curve(), ls="-" if row.cell.outer_lr_decay else "--", lw=1, label=f"DiLoCo {row.label}")
    left.set(xlabel="tokens (all replicas)", ylabel="held-out eval loss",
             title=f"M={centre.replicas}, {centre.cell.compression}: eval loss")
    lowest = min(line.get_ydata().min() for line in left.get_lines())
    left.set_ylim(lowest - 0.05, max(row.curve()[1][min(2, len(row.curve()[1]) - 1)] for row in shown) + 0.05)
    right.axhline(1.0, color="grey", ls=":", lw=1, label="goal: +1%")
    right.axhline(0.0, color="k", lw=0.8)
    right.set(xlabel="tokens (all replicas)", ylabel="gap to data-parallel (%)",
              title="gap to data-parallel at the same tokens")
    right.set_ylim(min(-2.0, right.get_ylim()[0]), min(right.get_ylim()[1] * 1.3, 60))  # room for the legend
    for axes in (left, right):
        axes.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.legend(fontsize=7, ncol=2, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def setup(args) -> str:
    numel = count_parameters(build_model(MODEL, 256, args.seq_len, 0))
    preset = PRESETS[MODEL]
    from peer.train.data import load_corpus
    from peer.train.tokenizer import ByteTokenizer

    corpus = load_corpus("shakespeare", ByteTokenizer(), args.seq_len, RunConfig().eval_fraction)
    eval_tokens = min(len(corpus.held_out) // args.seq_len, args.eval_batches * args.batch_size) * args.seq_len
    per_replica = args.tokens / args.replicas / len(corpus.train)  # of a pass, at the centre's M
    passes = (f"each of the centre's replicas reads {per_replica:.0%} of a pass, in an order of its own"
              + (", so it sees no window twice" if per_replica <= 1 else "") +
              "; the replicas' orders are independent, so a window may reach two of them")
    return (f"Model `{MODEL}`: Llama, hidden {preset.hidden}, {preset.layers} layers, "
            f"MLP {preset.intermediate}, byte vocabulary, {numel:,} parameters. Each replica steps on "
            f"{args.batch_size} x {args.seq_len} tokens; inner AdamW lr {args.lr:g}, {args.warmup_steps} warmup "
            f"steps, cosine to 10% over the run, clip 1.0, weight decay 0.1. Outer Nesterov lr 0.7, momentum 0.9 "
            f"(unless the cell says otherwise); robust mean clip factor 4; alignment every {args.align_every} "
            f"rounds. Every cell: {args.tokens / 1e6:.2f}M tokens over all replicas "
            f"({args.tokens / len(corpus.train):.0%} of one pass over the {len(corpus.train) / 1e6:.2f}M training "
            f"tokens, {passes}); held-out: the first {eval_tokens:,} tokens of the 2% tail of "
            f"every play. Seeds {', '.join(map(str, args.seeds))} (initial weights and data order; DiLoCo and "
            f"data-parallel with one seed see the same M streams).")


def sweep_report(rows: List[Row], lone: List[SimulationResult], args, argv: Sequence[str], runs: Runs) -> str:
    command = shlex.join(["python", "-m", "bench.convergence", *argv])
    initial = statistics.mean(r.initial_loss for r in rows[0].results)
    wall, cpu = runs.seconds
    parts = [f"Command: `{command}`. Its {runs.used} "
             f"runs took {cpu / 60:.0f} min of CPU ({wall / 60:.0f} min wall-clock) on "
             f"{torch.get_num_threads()} thread(s).",
             setup(args) + f" Initial held-out loss: {initial:.4f}.",
             "## Goal\n\n" + goal(rows, args)]
    if args.plot and args.out:
        parts.append(f"![held-out eval loss and its gap to data-parallel against tokens]"
                     f"({os.path.relpath(args.plot, args.out.parent)})")
    parts += ["## Every cell\n\n" + table(rows, args),
              "## The centre's gap over training\n\n" + gap_over_training(rows),
              "## Where the gap comes from\n\n" + gap_sources(rows, lone, args)]
    if effects(rows):
        parts.append("## Momentum alignment and error feedback, as measured\n\n" + effects(rows))
    return "\n\n".join(parts)


def write_section(path: Path, name: str, text: str, title: str) -> None:
    """Put ``text`` between this section's markers in ``path``, keeping everything else there."""
    start, end = SECTION.format(name=name), SECTION_END.format(name=name)
    block = f"{start}\n{text}\n{end}"
    old = path.read_text() if path.exists() else f"# {title}\n"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(new)


# ---------------------------------------------------------------- the multi-peer check
def multi_peer_settings(args) -> Dict[str, object]:
    """The run settings the real peers share and the simulation uses: the tiny preset at the tests' batch size."""
    return dict(model="tiny", batch_size=4, seq_len=64, lr=0.003, warmup_steps=5, inner_steps=args.peer_inner_steps,
                lr_decay_steps=args.rounds * args.peer_inner_steps, compression=args.compression,
                align_every=args.align_every, eval_every=5, eval_batches=args.peer_eval_batches, seed=0,
                outer_lr_decay=args.peer_outer_lr_decay)


def as_flags(settings: Dict[str, object]) -> List[str]:
    """Command-line flags for ``settings``; a switch (a bool) as ``--name`` or ``--no-name``."""
    flags = []
    for name, value in settings.items():
        flag = name.replace("_", "-")
        flags += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return flags


def run_peers(args, log_dir: Path) -> List[List[dict]]:
    """A bootstrap node and ``--peers`` real peers on loopback until each has done ``--rounds`` rounds; every
    process runs in its own session, and all are killed (their process groups) at the end."""
    from tests.harness.swarm import Swarm

    swarm = Swarm(log_dir)
    try:
        # the product's default deadlines, not the tests' short ones: a loaded CPU must not time a member out
        node = [*as_flags(dataclasses.asdict(SyncConfig())), "--max-rounds", str(args.rounds), "--run-id",
                "convergence", "--min-step-seconds", str(args.min_step_seconds)]
        peers = [swarm.peer(f"p{i}", *as_flags(multi_peer_settings(args)), *node) for i in range(args.peers)]
        for peer in peers:
            code = peer.wait(args.peer_timeout)
            if code != 0:
                raise RuntimeError(f"{peer.name} exited with {code}:\n{peer.stderr[-3000:]}")
        return [peer.metrics for peer in peers]
    finally:
        swarm.close()


def peer_schedule(metrics: List[List[dict]], peers: int) -> Optional[List[List[int]]]:
    """The real peers' inner steps, ``[round][peer]``, if every round of every peer was applied in a full group,
    so that the simulation can replay them; else None."""
    steps = []
    for records in metrics:
        if not all(r["applied"] and r["group_size"] == peers for r in records):
            return None
        steps.append([r["inner_steps"] for r in sorted(records, key=lambda r: r["epoch"])])
    return [list(round_steps) for round_steps in zip(*steps)] if len({len(s) for s in steps}) == 1 else None


def real_evaluations(metrics: List[List[dict]]) -> Dict[int, List[float]]:
    """{epoch: the held-out losses the peers that applied it report}."""
    losses: Dict[int, List[float]] = {}
    for records in metrics:
        for record in records:
            if record["applied"] and record["eval_loss"] is not None:
                losses.setdefault(record["epoch"], []).append(record["eval_loss"])
    return losses


def compare(real: float, simulated: List[float]) -> str:
    distance, spread = abs(real - statistics.mean(simulated)), max(simulated) - min(simulated)
    verdict = "within" if distance <= spread else "outside"
    return (f"{distance:.4f} from their mean, the seeds {spread:.4f} apart: **{verdict} seed noise** "
            f"({100 * (real / statistics.mean(simulated) - 1):+.2f}%)")


def multi_peer_report(metrics: List[List[dict]], simulations: Dict[str, List[SimulationResult]], args, argv,
                      log_dir: Path) -> str:
    evaluations, variant = real_evaluations(metrics), multi_peer_variant(args)
    reference = next(iter(simulations.values()))[0]
    epoch = max(e for e in evaluations if e in reference.eval_rounds)
    real = statistics.mean(evaluations[epoch])
    steps = [r["inner_steps"] for records in metrics for r in records]
    groups = sorted({r["group_size"] for records in metrics for r in records})
    sent = statistics.mean(r["bytes_sent"] for records in metrics for r in records[1:])
    simulated_sent = reference.bytes_sent[-1] / args.rounds
    command = shlex.join(["python", "-m", "bench.convergence", *argv])
    lines = [
        "## Multi-peer check: the product against the simulation" + (f" ({variant[1]})" if variant[1] else ""), "",
        f"Command: `{command}` (logs in {log_dir})", "",
        f"{args.peers} real `python -m peer` processes and a `python -m dht` bootstrap on loopback, started as the "
        f"tests start them (tests/harness/swarm.py) with the product's default sync deadlines, and the run settings "
        f"`{' '.join(as_flags(multi_peer_settings(args)))}` (the "
        f"tiny preset, 3.2M parameters: `python -m peer` has no smaller one; `--min-step-seconds "
        f"{args.min_step_seconds:g}` gives every peer the same pace on a shared CPU), {args.rounds} rounds each. "
        f"Against `simulate()` of the same configuration with M={args.peers}: with exactly H steps a round, and "
        f"replaying the steps each real peer did in each round (the swarm's schedule gives each peer H steps at the "
        f"median pace, so they vary).", "",
        f"| | eval loss at epoch {epoch} |", "|---|---|",
        f"| real peers ({len(evaluations[epoch])} evaluated G at epoch {epoch}: "
        f"{' / '.join(f'{x:.4f}' for x in evaluations[epoch])}) | {real:.4f} |",
    ]
    for name, results in simulations.items():
        lines += [f"| {name}, seed {seed} | {r.eval_losses[r.eval_rounds.index(epoch)]:.4f} |"
                  for seed, r in zip(args.peer_seeds, results)]
    lines.append("")
    for name, results in simulations.items():
        lines.append(f"- Against the {name}: the real swarm is "
                     f"{compare(real, [r.eval_losses[r.eval_rounds.index(epoch)] for r in results])}.")
    if len(simulations) == 1:
        lines.append("- Not replayed: some peer's round was not applied in a group of all of them (see the logs).")
    lines += [f"- Inner steps per peer and round: {min(steps)}-{max(steps)}, mean {statistics.mean(steps):.2f} "
              f"(H={args.peer_inner_steps}); group sizes seen: {groups}; rounds applied per peer: "
              f"{[sum(r['applied'] for r in records) for records in metrics]}.",
              f"- Bytes a real peer sent per round after the first (transport, matchmaking included): "
              f"{fmt_bytes(sent)}; the simulation counts {fmt_bytes(simulated_sent)} a round (one encoded copy of "
              f"what a replica contributes), and the butterfly sends 2(M-1)/M of that: "
              f"{fmt_bytes(simulated_sent * 2 * (args.peers - 1) / args.peers)}."]
    return "\n".join(lines)


def multi_peer_variant(args) -> Tuple[str, str]:
    """The report section's name, and what its heading adds: the plain check (int4) has a section of its own, and
    so does each variant of it."""
    variants = [(flag, f"`--{flag}`") for flag, on in (("outer-lr-decay", args.peer_outer_lr_decay),) if on]
    if args.compression != "int4":
        variants.append((args.compression, f"`--compression {args.compression}`"))
    return "".join(["multi-peer"] + [f"-{name}" for name, _ in variants]), ", ".join(text for _, text in variants)


def multi_peer(args, argv) -> str:
    log_dir = Path(tempfile.mkdtemp(prefix="convergence_"))
    print(f"logs: {log_dir}", flush=True)
    metrics = run_peers(args, log_dir)
    run = RunConfig(**multi_peer_settings(args))
    simulations = {"simulation, H steps": [simulate(run, args.peers, args.rounds, 5, seed) for seed in args.peer_seeds]}
    schedule = peer_schedule(metrics, args.peers)
    if schedule is not None:
        simulations["simulation replaying the peers' steps"] = [
            simulate(run, args.peers, args.rounds, 5, seed, schedule=schedule) for seed in args.peer_seeds]
    return multi_peer_report(metrics, simulations, args, argv, log_dir)


# ---------------------------------------------------------------- command line
def parse_args(argv: Sequence[str]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a small sweep for CI: {QUICK}")
    parser.add_argument("--tokens", type=int, default=2_500_000, help="tokens per cell, over all replicas")
    parser.add_argument("--replicas", type=int, default=4, help="the centre's M")
    parser.add_argument("--inner-steps", type=int, default=100, help="the centre's H")
    parser.add_argument("--compression", default="int4", help="the centre's codec")
    parser.add_argument("--align-every", type=int, default=4, help="momentum alignment every k rounds, where on")
    parser.add_argument("--axes", nargs="*", default=[axis for axis in AXES if axis not in OPT_IN], choices=AXES)
    parser.add_argument("--sweep-replicas", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--sweep-inner-steps", type=int, nargs="*", default=[10, 50, 100, 250])
    parser.add_argument("--codecs", nargs="*", default=["none", "fp16", "int8", "int4", "int4-huffman"])
    parser.add_argument("--outer-lrs", type=float, nargs="*", default=[0.4, 1.0])
    parser.add_argument("--decayed-outer-lrs", type=float, nargs="*", default=[0.7],
                        help="peak outer lrs of the outer-lr-decay axis")
    parser.add_argument("--warm-starts", type=float, nargs="*", default=[0.2],
                        help="fractions of the tokens trained data-parallel before DiLoCo starts")
    parser.add_argument("--warm-start-outer-warmups", type=int, nargs="*", default=[0],
                        help="the outer warm-ups (outer steps) the warm-start axis runs each fraction with")
    parser.add_argument("--outer-warmups", type=int, nargs="*", default=[4, 8],
                        help="outer steps of the outer-warmup axis (plain averaging blended into Nesterov)")
    parser.add_argument("--warmed-outer-lrs", type=float, nargs="*", default=[0.7],
                        help="the Nesterov outer lrs the outer-warmup axis blends into")
    parser.add_argument("--outer-momenta", type=float, nargs="*", default=[0.5, 0.8],
                        help="the Nesterov momenta of the outer-momentum axis (at the centre's outer lr)")
    parser.add_argument("--momentum-warmups", type=int, nargs="*", default=[0],
                        help="the outer warm-ups (outer steps) the outer-momentum axis runs each momentum with")
    parser.add_argument("--fragment-counts", type=int, nargs="*", default=[4],
                        help="F of the fragments axis (streaming: one of F fragments averaged every H/F steps)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=64)
    parser.add_argument("--evals", type=int, default=12, help="evaluations per run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, help="keep finished runs in this JSON file; a rerun resumes from it")
    parser.add_argument("--out", type=Path, help="write the report into this markdown file (its own section)")
    parser.add_argument("--plot", type=Path, help="write the plot to this PNG file")
    peers = parser.add_argument_group("the multi-peer check")
    peers.add_argument("--multi-peer", action="store_true")
    peers.add_argument("--peers", type=int, default=3)
    peers.add_argument("--rounds", type=int, default=20)
    peers.add_argument("--peer-inner-steps", type=int, default=20)
    peers.add_argument("--peer-eval-batches", type=int, default=32)
    peers.add_argument("--peer-outer-lr-decay", action="store_true",
                       help="the peers and the simulation run with --outer-lr-decay (its own report section)")
    peers.add_argument("--peer-seeds", type=int, nargs="*", default=[0, 1])
    peers.add_argument("--min-step-seconds", type=float, default=0.4)
    peers.add_argument("--peer-timeout", type=float, default=1200.0)
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    title = "Convergence: DiLoCo against synchronous data-parallel training"
    if args.multi_peer:
        text = multi_peer(args, argv)
        name = multi_peer_variant(args)[0]
    else:
        runs = Runs(args.cache)
        rows, lone = run_sweep(args, runs), lone_replica(runs, args)
        text, name = sweep_report(rows, lone, args, argv, runs), "sweep"
        if args.plot:
            plot(rows, args.plot)
    print(text, flush=True)
    if args.out:
        write_section(args.out, name, text, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
