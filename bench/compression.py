"""Wire codecs side by side with hivemind's, then what each does to training.

    python -m bench.compression --out bench/results/compression.md

Part 1, on Gaussian vectors of 1M, 16M and 64M floats: encode and decode throughput (MB of fp32 per
second, best of --repeats), bytes on the wire, and relative L2 error, for our codecs and for hivemind's
Float16Compression, Uniform8BitQuantization and BlockwiseQuantization measured in the same run (the last two
with numpy < 2.4 only: hivemind 1.1.12's 8-bit decoders fail on a newer numpy, and the table says so).

Part 2: eval loss after --rounds rounds of a --replicas replica DiLoCo simulation (bench/simulation.py:
the peer's own inner loop, error feedback, codecs and outer step), one run per codec, same seed and
same data, for each of --seeds; int4 also without error feedback, to show what the feedback buys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy
import torch
from diloco_compression import CODECS, get_codec
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)

from bench.simulation import simulate
from peer.config import RunConfig
from peer.train.model import build_model, count_parameters

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


class Hivemind:
    """hivemind's codec behind the interface of ours, for the table."""

    def __init__(self, codec, bits):
        self.codec, self.name, self.bits_per_value = codec, f"hivemind {type(codec).__name__}", bits

    def encode(self, values):
        return self.codec.compress(values, CompressionInfo.from_tensor(values))

    def decode(self, data, numel):
        return self.codec.extract(data)

    @staticmethod
    def size(data):
        return data.ByteSize()


def best_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def hivemind_codecs():
    """hivemind's codecs for the table, and a note on those left out. Its 8-bit decoders read a length with int() of
    a one-element numpy array, which numpy 2.4 made an error: with such a numpy they cannot decode, so they are out."""
    codecs = [Hivemind(NoCompression(), 32), Hivemind(Float16Compression(), 16)]
    eight_bit = [Hivemind(Uniform8BitQuantization(), 8), Hivemind(BlockwiseQuantization(), 8)]
    try:
        for codec in eight_bit:
            codec.decode(codec.encode(torch.zeros(8)), 8)
    except TypeError as e:
        return codecs, (f"hivemind's 8-bit codecs are left out: their decoders fail on numpy {numpy.__version__} "
                        f"({e}); run this with numpy<2.4 to measure them.")
    return codecs + eight_bit, ""


def codec_table(sizes, repeats: int) -> str:
    ours = list(CODECS.values())
    theirs, left_out = hivemind_codecs()
    rows = ["| floats | codec | bits/value | encode MB/s | decode MB/s | bytes | relative error |",
            "|---|---|---|---|---|---|---|"]
    for label in sizes:
        values = torch.randn(SIZES[label], generator=torch.Generator().manual_seed(0))
        megabytes = values.numel() * 4 / 1e6
        for codec in sorted(ours + theirs, key=lambda c: (-c.bits_per_value, c.name.startswith("hivemind"))):
            data = codec.encode(values)
            decoded = codec.decode(data, values.numel())
            size = Hivemind.size(data) if isinstance(codec, Hivemind) else len(data)
            error = ((values - decoded.reshape(-1)).norm() / values.norm()).item()
            encode = best_seconds(lambda: codec.encode(values), repeats)
            decode = best_seconds(lambda: codec.decode(data, values.numel()), repeats)
            rows.append(f"| {label} | {codec.name} | {8 * size / values.numel():.3f} | {megabytes / encode:,.0f} | "
                        f"{megabytes / decode:,.0f} | {size:,} | {error:.2e} |")
            print(rows[-1], flush=True)
    return "\n".join(rows + ["", left_out] if left_out else rows)


def simulation_table(args) -> str:
    base = dict(model="tiny", batch_size=args.batch_size, seq_len=args.seq_len, inner_steps=args.inner_steps,
                lr=args.lr, warmup_steps=args.warmup_steps, lr_decay_steps=args.rounds * args.inner_steps,
                align_every=args.align_every, eval_batches=args.eval_batches)
    cells = [(name, True) for name in ("none", "fp16", "int8", "int4")] + [("int4", False)]
    numel = count_parameters(build_model("tiny", 256, args.seq_len, 0))
    losses = {}
    seeds = " / ".join(f"seed {seed}" for seed in args.seeds)
    rows = [f"| codec | error feedback | eval loss ({seeds}) | mean | vs none (mean of per-seed gaps) "
            f"| wire bytes of one Δ |", "|---|---|---|---|---|---|"]
    for name, feedback in cells:
        for seed in args.seeds:
            start = time.perf_counter()
            run = RunConfig(compression=name, error_feedback=feedback, seed=seed, **base)
            losses[(name, feedback, seed)] = simulate(run, args.replicas, args.rounds, seed=seed).eval_losses[-1]
            print(f"{name} feedback={feedback} seed={seed}: {losses[(name, feedback, seed)]:.4f} "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
        mine = [losses[(name, feedback, seed)] for seed in args.seeds]
        gaps = [losses[(name, feedback, seed)] / losses[("none", True, seed)] - 1 for seed in args.seeds]
        rows.append(f"| {name} | {'on' if feedback else 'off'} | {' / '.join(f'{x:.4f}' for x in mine)} | "
                    f"{statistics.mean(mine):.4f} | {100 * statistics.mean(gaps):+.2f}% | "
                    f"{get_codec(name).wire_bytes(numel):,} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--align-every", type=int, default=4)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--skip-simulation", action="store_true")
    parser.add_argument("--out", help="also write the tables, with the command, to this markdown file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    sections = [f"Command: `python -m bench.compression {' '.join(argv if argv is not None else sys.argv[1:])}`",
                f"torch {torch.__version__}, {torch.get_num_threads()} threads; codecs: {', '.join(CODECS)}",
                "## Codecs\n\n" + codec_table(args.sizes, args.repeats)]
    if not args.skip_simulation:
        sections.append(f"## Training: {args.replicas} replicas, {args.rounds} rounds of H={args.inner_steps} "
                        f"(tiny model, batch {args.batch_size}x{args.seq_len})\n\n" + simulation_table(args))
    report = "\n\n".join(sections) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Compression benchmark\n\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
