"""How far lossless coding could shrink what a replica sends at the convergence sweep's centre.

    python -m bench.entropy --out bench/results/entropy.md [--seeds 0 1]

Issue 6 asks for 1000x fewer bytes than data-parallel at M=4, H=100, int4; the sweep measures 602x with NF4. This
bench asks whether entropy coding NF4's codes, which changes no value the replicas compute, could close that. It
cannot (671x at best, bench/results/entropy.md): NF4's levels fit a normal block, so its codes are used about
equally. That is why ``int4-huffman`` (compression/huffman.py) codes a uniform int4 grid instead (1,116x).

It runs the sweep's centre (``bench.convergence``: its default budget, M, H, codec, error feedback and
momentum alignment) through ``simulate()`` and looks at every vector a replica sends, encoded part by part
(``CHUNK_VALUES``) as the wire carries it:

- wire: the codec's own bytes, which the sweep counts;
- order-0 entropy: each part's code histogram, ``-sum p log2 p`` bits a code, plus the fp32 scales as they
  are sent. An ideal per-symbol coder (Huffman, rANS) reaches it and none does better;
- zlib: Python's zlib at level 9 over the encoded part (codes and scales), a real coder that also exploits
  repeats, so it can land below the order-0 figure.

Each turns into the ratio to data-parallel as the sweep computes it: data-parallel sends a 32-bit gradient
value every step, a replica sends its bits per value per round (its delta every round, its first moments
every ``align_every`` rounds) every H steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from diloco_compression import Codec, get_codec
from diloco_compression.feedback import CHUNK_VALUES

from bench.convergence import cell_rounds, cell_run, cells
from bench.convergence import parse_args as convergence_args
from bench.simulation import simulate

MEASURES = ("wire", "order-0 entropy", "zlib")


def part_bits(codec: Codec, part: torch.Tensor) -> Dict[str, float]:
    """Bits of one encoded part under each measure."""
    data = codec.encode(part)
    scale_bytes = 4 * codec.blocks(part.numel())
    codes = np.frombuffer(data, dtype=np.uint8, offset=scale_bytes)
    if codec.code_bits == 4:  # two codes a byte, high nibble first
        codes = np.stack([codes >> 4, codes & 15], axis=1).reshape(-1)[: part.numel()]
    share = np.bincount(codes, minlength=1 << codec.code_bits) / codes.size
    share = share[share > 0]
    entropy = float(-(share * np.log2(share)).sum())
    return {"wire": 8.0 * len(data), "order-0 entropy": 8.0 * scale_bytes + entropy * part.numel(),
            "zlib": 8.0 * len(zlib.compress(data, 9))}


class Tally:
    """Bits and values sent, per kind of vector and measure."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.bits: Dict[str, Dict[str, float]] = defaultdict(lambda: dict.fromkeys(MEASURES, 0.0))
        self.values: Dict[str, int] = defaultdict(int)

    def __call__(self, kind: str, vector: torch.Tensor) -> None:
        for start in range(0, vector.numel(), CHUNK_VALUES):
            for measure, bits in part_bits(self.codec, vector[start: start + CHUNK_VALUES]).items():
                self.bits[kind][measure] += bits
        self.values[kind] += vector.numel()


def report(tallies: List[Tally], run, replicas: int, rounds: int, numel: int, command: str) -> str:
    kinds = list(tallies[0].values)
    lines = [
        "# Lossless coding of what a replica sends: the byte ratio's ceiling", "",
        f"Command: `{command}`", "",
        f"The convergence sweep's centre: M={replicas}, H={run.inner_steps}, {run.compression}, error feedback "
        f"{'on' if run.error_feedback else 'off'}, momentum alignment every {run.align_every} rounds, "
        f"{rounds} rounds, {numel:,} parameters; {len(tallies)} seed(s). Bits per value sent, over every part of "
        f"every vector of every replica and round:", "",
        "| measure | " + " | ".join(f"{kind} bits/value" for kind in kinds)
        + " | bits/value/round | ratio to data-parallel |",
        "|---|" + "---|" * (len(kinds) + 2),
    ]
    for measure in MEASURES:
        per_kind = {kind: statistics.mean(t.bits[kind][measure] / t.values[kind] for t in tallies) for kind in kinds}
        per_round = statistics.mean(sum(t.bits[kind][measure] for kind in kinds) / (rounds * replicas * numel)
                                    for t in tallies)
        ratio = run.inner_steps * 32 / per_round
        lines.append(f"| {measure} | " + " | ".join(f"{per_kind[kind]:.3f}" for kind in kinds)
                     + f" | {per_round:.3f} | {ratio:,.0f}x |")
    needed = run.inner_steps * 32 / 1000
    lines += ["", f"1000x at H={run.inner_steps} needs at most {needed:.2f} bits per value per round, all sends "
              f"included."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sweep = convergence_args([])
    centre = cells(sweep)[0]
    run, rounds = cell_run(centre, sweep), cell_rounds(centre, sweep)
    tallies = []
    for seed in args.seeds:
        tallies.append(Tally(get_codec(run.compression)))
        simulate(run, centre.replicas, rounds, eval_every=rounds, seed=seed, observe=tallies[-1])
    numel = tallies[0].values["delta"] // (rounds * centre.replicas)
    text = report(tallies, run, centre.replicas, rounds, numel, "python -m bench.entropy " + " ".join(argv))
    print(text, flush=True)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
