"""One rank of the synchronous data-parallel baseline that ``bench.goodput`` runs against the swarm.

    python -m bench.sync_worker --rank R --world-size N --port P --checkpoint-dir D --metrics-file F [peer flags]

DDP over gloo: the gradient is averaged at every step, so one lost or frozen rank stops every rank. It
uses the peer's own parts (model preset, data stream, AdamW schedule, atomic checkpoint, step pacing)
with the same run flags, so the two sides differ only in how they synchronise. Every H steps (one
swarm round's worth) rank 0 writes a checkpoint and a metrics record whose ``tokens_total`` counts
the tokens behind the checkpointed weights: work since the last checkpoint is lost when a rank dies,
because the job restarts from that checkpoint, as data-parallel training must.

``bench.head_to_head`` runs it across namespaces (``--master IP``, ``GLOO_SOCKET_IFNAME``) without a checkpoint
(as its peers run), with the peers' schedule flags, and with ``--eval-every K``: every K records rank 0 also
evaluates on the peers' held-out batches (``eval_loss``); a first record at epoch 0 holds the initial loss.
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
from peer.train.inner import InnerTrainer, mean_loss
from peer.train.model import build_model
from peer.train.tokenizer import load_tokenizer

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # outlasts a 30 s freeze: the job waits, as DDP does


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master", default="127.0.0.1", help="rank 0's address (its rendezvous)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--checkpoint-dir", help="rank 0 checkpoints every H steps; a relaunch resumes from it")
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-step-seconds", type=float, default=0.0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--inner-steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--lr-decay-steps", type=int, default=RunConfig.lr_decay_steps)
    parser.add_argument("--eval-every", type=int, default=0, help="records between evaluations (0 = never)")
    parser.add_argument("--eval-batches", type=int, default=RunConfig.eval_batches)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    run = RunConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, inner_steps=args.inner_steps,
                    lr=args.lr, warmup_steps=args.warmup_steps, lr_decay_steps=args.lr_decay_steps,
                    eval_batches=args.eval_batches, seed=args.seed).resolved()

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                            world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    tokenizer = load_tokenizer(run.tokenizer)
    corpus = load_corpus(run.dataset, tokenizer, run.seq_len, run.eval_fraction)
    model = build_model(run.model, tokenizer.vocab_size, run.seq_len, run.seed)
    trainer = InnerTrainer(torch.nn.parallel.DistributedDataParallel(model), run, torch.device("cpu"),
                           min_step_seconds=args.min_step_seconds)
    step = resume(args.checkpoint_dir, model, trainer)
    stream = corpus.stream(run.seed, f"rank{args.rank}", step * run.batch_size)
    batches = iter(lambda: stream.next_batch(run.batch_size), None)
    held_out = corpus.eval_batches(run.eval_batches, run.batch_size) if args.eval_every and args.rank == 0 else []
    if held_out and step == 0:
        write(args.metrics_file, dict(time=time.time(), epoch=0, tokens_total=0, eval_loss=mean_loss(model, held_out)))
    tokens_per_step = args.world_size * run.batch_size * run.seq_len
    while True:
        stats = trainer.train(batches, run.inner_steps, step)
        step += stats.steps
        if args.rank == 0:
            checkpoint(args.checkpoint_dir, model, trainer, step)
            epoch = step // run.inner_steps
            evaluated = mean_loss(model, held_out) if held_out and epoch % args.eval_every == 0 else None
            write(args.metrics_file, dict(time=time.time(), epoch=epoch, loss=stats.loss,
                                          tokens=stats.tokens * args.world_size, tokens_total=step * tokens_per_step,
                                          compute_seconds=stats.compute_seconds, sync_seconds=0.0, applied=True,
                                          error=None, eval_loss=evaluated))
        dist.barrier()


def resume(directory, model: torch.nn.Module, trainer: InnerTrainer) -> int:
    """The step of the checkpoint in ``directory`` (loaded into the model and optimizer), or 0."""
    if directory is None:
        return 0
    os.makedirs(directory, exist_ok=True)
    payload = load_checkpoint(directory)
    if payload is None:
        return 0
    model.load_state_dict(payload["model"])
    trainer.optimizer.load_state_dict(payload["optimizer"])
    trainer.local_steps = int(payload["step"])
    return trainer.local_steps


def checkpoint(directory, model: torch.nn.Module, trainer: InnerTrainer, step: int) -> None:
    if directory is not None and not save_checkpoint(directory, dict(model=model.state_dict(),
                                                                     optimizer=trainer.optimizer.state_dict(),
                                                                     step=step)):
        # a baseline that cannot checkpoint would restart from scratch at every kill: a wrong result
        raise SystemExit(f"rank 0: checkpoint not written to {directory}: the baseline is void")


def write(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        os._exit(130)
