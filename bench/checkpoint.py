"""Checkpoints off the training path: how long the training thread stops for a checkpoint, before and after.

    python -m bench.checkpoint --models tiny small 150m --out bench/results/checkpoint.md

For each preset: a peer's state on the CPU (the model and AdamW after one step, G, m, the error-feedback residual),
checkpointed to a directory on this machine's disk, both ways:

- in the training thread (the peer until the background writer): theta gathered, then ``torch.save`` of the live
  tensors, fsync, rename, fsync of the directory, under the lock;
- off it (now): ``peer.round.checkpoints.snapshot`` (every tensor copied in memory, under the lock) is what the training
  thread waits for; ``CheckpointWriter``'s thread writes it.

Also the inner step right after the snapshot, while the writer writes, against the same steps with no write (on a
CPU the writer takes cycles from it: a cost in CPU, not a wait for the disk), and the snapshot's bytes: the memory
one write holds.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dht.manifest import RunManifest
from peer.config import RunConfig
from peer.ops.checkpoint import CheckpointPayload, CheckpointWriter
from peer.outer.state import GlobalState
from peer.round.build import Progress
from peer.round.checkpoints import snapshot
from peer.train.flat import FlatLayout
from peer.train.inner import InnerTrainer
from peer.train.local import LocalModel
from peer.train.model import build_model
from peer.train.tokenizer import load_tokenizer

STEPS = 3  # inner steps timed with and without a write


def peer_state(preset: str, batch: int, seq_len: int) -> SimpleNamespace:
    """What ``snapshot`` reads of a peer: its parts, on the CPU, after one inner step."""
    run = RunConfig(model=preset, batch_size=batch, seq_len=seq_len).resolved()
    vocab = load_tokenizer(run.tokenizer).vocab_size
    trainer = InnerTrainer(build_model(preset, vocab, seq_len, seed=0), run, torch.device("cpu"))
    batches = iter(lambda: torch.randint(0, vocab, (batch, seq_len)), None)
    trainer.train(batches, 1, 0)
    layout = FlatLayout(trainer.params)
    state = GlobalState(params=layout.gather(trainer.params, layout.empty()), momentum=torch.randn(layout.numel))
    return SimpleNamespace(
        state=state, progress=Progress(), manifest=RunManifest("bench", run.to_settings()), peer_id="bench",
        layout=layout, trainer=trainer, local=LocalModel(trainer, layout), stream=SimpleNamespace(position=0),
        lock=threading.Lock(),
        feedback=SimpleNamespace(residual=torch.randn(layout.numel)),
        lineage=SimpleNamespace(carried=None, recovered_tokens=0), batches=batches)


def in_the_training_thread(parts, directory: str) -> float:
    """The old way: the live tensors saved by the training thread, under the lock."""
    start = time.perf_counter()
    state = parts.state
    with parts.lock:
        CheckpointPayload(
            manifest_hash=parts.manifest.hash, manifest_record=parts.manifest.to_record(), run_id="bench",
            peer_id="bench", params=state.params, momentum=state.momentum, epoch=0, tokens_total=0, merged={},
            theta=parts.layout.gather(parts.trainer.params, parts.layout.empty()),
            optimizer=parts.trainer.optimizer.state_dict(), local_steps=1, data_position=0, pending_tokens=0,
            pending_rounds=0, rounds=0, residual=parts.feedback.residual).save(directory)
    return time.perf_counter() - start


def steps(parts) -> list:
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        parts.trainer.train(parts.batches, 1, 0)
        times.append(time.perf_counter() - start)
    return times


def measure(preset: str, batch: int, seq_len: int, directory: str) -> dict:
    parts = peer_state(preset, batch, seq_len)
    alone = steps(parts)
    blocking = in_the_training_thread(parts, directory)
    start = time.perf_counter()
    with parts.lock:
        payload = snapshot(parts, "bench")
    paused = time.perf_counter() - start
    held = sum(t.numel() * t.element_size() for t in (payload.params, payload.momentum, payload.theta,
                                                     payload.residual))
    held += sum(t.numel() * t.element_size() for s in payload.optimizer["state"].values() for t in s.values())
    write = []

    def timed(directory, saved, before_rename):
        start = time.perf_counter()
        saved.save(directory, before_rename)
        write.append(time.perf_counter() - start)

    writer = CheckpointWriter(directory, save=timed)
    writer.submit(payload)
    del payload
    during = steps(parts)[0]  # the step right after the snapshot: the writer writes meanwhile
    writer.close()
    return dict(preset=preset, params=parts.layout.numel, blocking=blocking, paused=paused, held=held,
                file=(Path(directory) / "state.pt").stat().st_size, written=write[0],
                alone=statistics.median(alone), during=during)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small", "150m"])
    parser.add_argument("--batch", type=int, default=1, help="sequences per timed inner step (default: 1)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", type=Path, help="write the table here (markdown) as well as printing it")
    args = parser.parse_args()
    rows = []
    for preset in args.models:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-checkpoint-") as directory:
            rows.append(measure(preset, args.batch, args.seq_len, directory))
            print(rows[-1], flush=True)
    gib = 2**30
    lines = ["# Checkpoints off the training path", "", "Command (2 CPU cores, no GPU on this machine):", "",
             "    " + " ".join(["python -m bench.checkpoint", *sys.argv[1:]]), "",
             f"Measured {datetime.date.today()}, torch {torch.__version__}; inner steps of {args.batch} x "
             f"{args.seq_len} tokens; seconds:", "",
             "| preset | parameters | file GiB | training thread stopped, before (write in it) | after (snapshot) | "
             "snapshot GiB (held while writing) | write in the background | inner step, no write (median) | "
             "the step after the snapshot, while writing |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['params'] / 1e6:.1f}M | {r['file'] / gib:.2f} | {r['blocking']:.2f} | "
                     f"{r['paused']:.2f} | {r['held'] / gib:.2f} | {r['written']:.2f} | {r['alone']:.2f} | "
                     f"{r['during']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
