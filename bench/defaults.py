"""The run defaults side by side on a larger preset: today's against the new, and each change of the new alone.

    nice -n 10 python -m bench.defaults --model small --out bench/results/defaults.md --cache /tmp/defaults.json

Every configuration trains M replicas in one process with ``bench/simulation.py`` (the peers' own inner loop,
codecs, error feedback, token weighting, robust mean, outer step, alignment, fragments and overlap) on the same
token budget, against synchronous data-parallel training of the same model on the same streams. Overlap is modelled
as the average landing a fraction of the way into the next round (``--overlap-fractions F=FRACTION``: the share of
a round a sync took on real peers with F fragments over the link in question, ``bench/results/wan.md``); what it
buys, compute that does not wait for the link, is measured there.

The configurations: ``today`` (the defaults before issue 25: fp16, the first moment averaged every 4 rounds, whole
rounds, no overlap), ``new`` (the defaults as they are now, or ``--new``), and ``new`` with one setting put back to
today's value each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from bench.convergence import Runs, fmt_bytes
from peer.config import NodeConfig, RunConfig
from peer.train.model import build_model, count_parameters

TODAY = dict(compression="fp16", align_every=4, fragments=1, overlap=False)  # the defaults before issue 25


def configurations(candidate: Dict[str, str], ablations: Optional[List[str]] = None) -> Dict[str, dict]:
    """today, the new (RunConfig's defaults, or ``candidate``: settings to weigh before they become defaults), and
    the new with each setting that differs from today's (or each of ``ablations``) put back alone."""
    defaults = {**vars(RunConfig()), **vars(NodeConfig())}
    new = {name: defaults[name] for name in TODAY}
    new.update({k: v == "True" if isinstance(TODAY[k], bool) else type(TODAY[k])(v) for k, v in candidate.items()})
    return {"today": TODAY, "new": new,
            **{f"new, {name} {TODAY[name]}": dict(new, **{name: TODAY[name]}) for name in TODAY
               if TODAY[name] != new[name] and (ablations is None or name in ablations)}}


def run_of(settings: dict, args, rounds: int) -> RunConfig:
    inner, run_settings = args.inner_steps, {k: v for k, v in settings.items() if k != "overlap"}
    return RunConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=args.warmup_steps, eval_batches=args.eval_batches, inner_steps=inner,
                     lr_decay_steps=rounds * inner // settings.get("fragments", 1), **run_settings)


def rounds_of(settings: dict, args) -> int:
    per_round = args.replicas * args.batch_size * args.seq_len * args.inner_steps // settings.get("fragments", 1)
    return max(1, round(args.tokens / per_round))


def measure(args, runs: Runs) -> List[dict]:
    rows = []
    steps = rounds_of({}, args) * args.inner_steps
    base = RunConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=args.warmup_steps, eval_batches=args.eval_batches, lr_decay_steps=steps)
    baseline = [runs._get(dict(kind="data-parallel", settings=base.to_settings(), replicas=args.replicas, steps=steps,
                               seed=seed, eval_every=steps),
                          lambda seed=seed: _data_parallel(base, args, steps, seed)) for seed in args.seeds]
    for name, settings in configurations(args.new, args.ablations).items():
        rounds = rounds_of(settings, args)
        run = run_of(settings, args, rounds)
        seeds = args.seeds if name in ("today", "new") or args.all_seeds else args.seeds[:1]
        overlap = args.overlap_fractions[settings["fragments"]] if settings["overlap"] else 0.0
        results = [runs._get(dict(kind="diloco", label=name, settings=run.to_settings(), replicas=args.replicas,
                                  rounds=rounds, seed=seed, eval_every=rounds, overlap=overlap),
                             lambda seed=seed: _simulate(run, args, rounds, seed, overlap)) for seed in seeds]
        reference = statistics.mean(b.eval_losses[-1] for b in baseline[: len(seeds)])
        loss = statistics.mean(r.eval_losses[-1] for r in results)
        rows.append(dict(name=name, settings=settings, rounds=rounds, losses=[r.eval_losses[-1] for r in results],
                         loss=loss, gap=100 * (loss / reference - 1), sent=statistics.mean(r.bytes_sent[-1]
                                                                                          for r in results)))
    rows.append(dict(name="data-parallel", losses=[b.eval_losses[-1] for b in baseline],
                     loss=statistics.mean(b.eval_losses[-1] for b in baseline), sent=baseline[0].bytes_sent[-1]))
    return rows


def _simulate(run: RunConfig, args, rounds: int, seed: int, overlap: float):
    from bench.simulation import simulate

    return simulate(run, args.replicas, rounds, rounds, seed, overlap=overlap)


def _data_parallel(run: RunConfig, args, steps: int, seed: int):
    from bench.simulation import data_parallel

    return data_parallel(run, args.replicas, steps, steps, seed)


def report(rows: List[dict], args, argv: List[str]) -> str:
    params = count_parameters(build_model(args.model, 256, args.seq_len, 0))
    today = next(r for r in rows if r["name"] == "today")
    outer = RunConfig(inner_steps=args.inner_steps)
    lines = [
        f"Command: `python -m bench.defaults {' '.join(argv)}`", "",
        f"Model `{args.model}` ({params:,} parameters), M={args.replicas} replicas, H={args.inner_steps}, "
        f"{args.batch_size} x {args.seq_len} tokens a step, {args.tokens / 1e6:.2f}M tokens in all, inner lr "
        f"{args.lr:g} with {args.warmup_steps} warm-up steps and a cosine to 10% over the run; the outer schedule is "
        f"RunConfig's (warm-up over {outer.outer_warmup_steps()} outer steps, Nesterov lr {outer.outer_lr:g}, "
        f"momentum {outer.outer_momentum_steady():g}). Held-out "
        f"eval: {args.eval_batches} batches. Seeds {', '.join(map(str, args.seeds))} for today and new, "
        f"{'and for the others' if args.all_seeds else 'the first for the others'}. With overlap, the average "
        f"lands this far into the next round: "
        f"{', '.join(f'F={f}: {x:.0%}' for f, x in args.overlap_fractions.items())}.",
        "",
        "| configuration | settings | rounds | eval loss per seed | mean | gap to data-parallel | bytes a replica "
        "sent | today's bytes / these |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        settings = ", ".join(f"{k}={v}" for k, v in row.get("settings", {}).items()) or "every step, fp32"
        gap = f"{row['gap']:+.2f}%" if "gap" in row else "-"
        lines.append(f"| {row['name']} | {settings} | {row.get('rounds', '-')} | "
                     f"{' / '.join(f'{x:.4f}' for x in row['losses'])} | {row['loss']:.4f} | {gap} | "
                     f"{fmt_bytes(row['sent'])} | {today['sent'] / row['sent']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=48, help="H (a multiple of every fragment count)")
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens per configuration, all replicas")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--all-seeds", action="store_true", help="run the ablations on every seed too (default: "
                                                                 "the first only)")
    parser.add_argument("--cache", type=Path, help="keep finished runs here; a rerun resumes")
    parser.add_argument("--overlap-fractions", nargs="*", default=["1=0.3", "4=0.45"], metavar="F=FRACTION",
                        help="with overlap and F fragments, how far into the next round the average lands (measured: "
                             "a sync's wall time over a round's, bench/results/wan.md at 20 Mbit/s)")
    parser.add_argument("--new", nargs="*", default=[], metavar="NAME=VALUE",
                        help=f"the new settings to weigh (of {', '.join(TODAY)}); default: RunConfig's defaults")
    parser.add_argument("--ablations", nargs="*", choices=list(TODAY), metavar="NAME",
                        help=f"put back only these settings alone (of {', '.join(TODAY)}); default: each that differs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.new = dict(item.split("=", 1) for item in args.new)
    args.overlap_fractions = {int(k): float(v) for k, v in (item.split("=") for item in args.overlap_fractions)}
    torch.set_num_threads(args.threads)
    rows = measure(args, Runs(args.cache))
    text = report(rows, args, argv)
    print(text)
    if args.out:
        args.out.write_text(f"# The run defaults side by side, simulated on `{args.model}`\n\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
