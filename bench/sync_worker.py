"""One rank of the synchronous data-parallel baseline that ``bench.goodput`` runs against the swarm.

    python -m bench.sync_worker --rank R --world-size N --port P --checkpoint-dir D --metrics-file F [peer flags]

DDP over gloo: the gradient is averaged at every step, so one lost or frozen rank stops every rank. It
uses the peer's own parts (model preset, data stream, AdamW schedule, atomic checkpoint, step pacing)
with the same run flags, so the two sides differ only in how they synchronise. Every H steps (one
swarm round's worth) rank 0 writes a checkpoint and a metrics record whose ``tokens_total`` counts
the tokens behind the checkpointed weights: work since the last checkpoint is lost when a rank dies,
because the job restarts from that checkpoint, as data-parallel training must.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from peer.config import RunConfig
from peer.ops.checkpoint import load_checkpoint, save_checkpoint
from peer.train.data import load_corpus
from peer.train.inner import InnerTrainer
from peer.train.model import build_model
from peer.train.tokenizer import load_tokenizer

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # outlasts a 30 s freeze: the job waits, as DDP does


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-step-seconds", type=float, default=0.0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--inner-steps", type=int)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = RunConfig(model=args.model, batch_size=args.batch_size, inner_steps=args.inner_steps,
                    seed=args.seed).resolved()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    tokenizer = load_tokenizer(run.tokenizer)
    corpus = load_corpus(run.dataset, tokenizer, run.seq_len, run.eval_fraction)
    model = build_model(run.model, tokenizer.vocab_size, run.seq_len, run.seed)
    trainer = InnerTrainer(torch.nn.parallel.DistributedDataParallel(model), run, torch.device("cpu"),
                           min_step_seconds=args.min_step_seconds)
    step = 0
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    payload = load_checkpoint(args.checkpoint_dir)
    if payload is not None:
        model.load_state_dict(payload["model"])
        trainer.optimizer.load_state_dict(payload["optimizer"])
        step = trainer.local_steps = int(payload["step"])
    stream = corpus.stream(run.seed, f"rank{args.rank}", step * run.batch_size)
    batches = iter(lambda: stream.next_batch(run.batch_size), None)
    tokens_per_step = args.world_size * run.batch_size * run.seq_len
    while True:
        stats = trainer.train(batches, run.inner_steps, step)
        step += stats.steps
        if args.rank == 0:
            if not save_checkpoint(args.checkpoint_dir, dict(model=model.state_dict(),
                                                             optimizer=trainer.optimizer.state_dict(), step=step)):
                # a baseline that cannot checkpoint would restart from scratch at every kill: a wrong result
                raise SystemExit(f"rank 0: checkpoint not written to {args.checkpoint_dir}: the baseline is void")
            record = dict(time=time.time(), epoch=step // run.inner_steps, loss=stats.loss,
                          tokens=stats.tokens * args.world_size, tokens_total=step * tokens_per_step,
                          compute_seconds=stats.compute_seconds, sync_seconds=0.0, applied=True, error=None)
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
        dist.barrier()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        os._exit(130)
