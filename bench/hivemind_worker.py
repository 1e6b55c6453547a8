"""One worker of the hivemind.Optimizer baseline that ``bench.wan`` runs against the swarm's peers.

    python -m bench.hivemind_worker --initial-peers MADDR --host-maddrs /ip4/IP/tcp/0 --run-id wan-hm \
        --target-batch-size 240 --metrics-file W.jsonl [--model tiny --batch-size 4 --seq-len 128 ...]

hivemind's own optimizer with ``use_local_updates=True``: every step is a local AdamW step, and whenever
the swarm has processed ``--target-batch-size`` samples (an epoch) the workers average their parameters,
by default on a background thread (``delay_state_averaging``, with hivemind's delta rule; in hivemind 1.1.12
the next local step still waits for that round to finish), or with ``--no-delay-state-averaging`` inside
the step that ends the epoch. It trains the peer's model on the peer's data (``peer.train.model``,
``peer.train.data``) with the same batch, pacing and threads, and appends a JSON line per epoch that
``bench.wan`` reads like a peer's metrics: ``compute_seconds`` (forward, backward, the local AdamW step
and the pacing pad, as a peer counts its inner steps) and ``time``, so both systems get one metric. The
AdamW lr follows the peer's schedule (``--lr``, ``--warmup-steps``, ``--lr-decay-steps``: linear warmup,
cosine decay). With ``--eval-every K``, every K epochs a worker also evaluates its model on the peers'
held-out batches (``eval_loss``, ``bench.head_to_head``), and ``tokens_total`` counts the epochs' samples.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

import hivemind
import torch
from hivemind.compression import Float16Compression

from dht.node import DHTConfig, start_dht
from dht.processes import fork_children
from peer.config import RunConfig
from peer.train.data import load_corpus
from peer.train.inner import mean_loss
from peer.train.model import build_model
from peer.train.tokenizer import load_tokenizer

AVERAGED = re.compile(r"Averaged parameters with (\d+) peers")


class AveragingLog(logging.Handler):
    """Counts hivemind's own reports of its background averaging rounds (group size, failures) between two
    epochs: the optimizer returns nothing that says how a delayed round went."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.groups, self.failures = [], 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        match = AVERAGED.search(message)
        if match:
            self.groups.append(int(match.group(1)))
        elif "Averaging failed" in message or "Background update failed" in message:
            self.failures += 1

    def take(self):
        groups, failures, self.groups, self.failures = self.groups, self.failures, [], 0
        return groups, failures


def timed_adamw(run: RunConfig, clock: dict):
    """An optimizer factory for hivemind.Optimizer: the peer's inner AdamW, whose steps are timed into
    ``clock['adamw']`` (hivemind runs them on its executor thread; the training thread waits for them)."""

    def factory(params):
        optimizer = torch.optim.AdamW(params, lr=run.lr, betas=(0.9, 0.95), weight_decay=run.weight_decay)
        step = optimizer.step

        def timed_step(*args, **kwargs):
            start = time.monotonic()
            try:
                return step(*args, **kwargs)
            finally:
                clock["adamw"] += time.monotonic() - start

        optimizer.step = timed_step
        return optimizer

    return factory


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"])
    parser.add_argument("--run-id", default="wan-hivemind")
    parser.add_argument("--metrics-file", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--target-batch-size", type=int, required=True,
                        help="samples the whole swarm processes per epoch (one parameter averaging)")
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="as the peers' --grace-seconds")
    parser.add_argument("--averaging-timeout", type=float, default=60.0, help="as the peers' --allreduce-timeout")
    parser.add_argument("--delay-state-averaging", action=argparse.BooleanOptionalAction, default=True,
                        help="average in the background (hivemind's default) or inside the step that ends an epoch")
    parser.add_argument("--min-step-seconds", type=float, default=0.0, help="pad every step to this long")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="initial weights (the same on every worker)")
    parser.add_argument("--shard", default="0", help="this worker's data order")
    parser.add_argument("--lr", type=float, help="peak AdamW lr (default: the preset's)")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: the preset's)")
    parser.add_argument("--lr-decay-steps", type=int, default=RunConfig.lr_decay_steps)
    parser.add_argument("--eval-every", type=int, default=0, help="epochs between evaluations (0 = never)")
    parser.add_argument("--eval-batches", type=int, default=RunConfig.eval_batches)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    fork_children()
    torch.set_num_threads(args.threads)
    run = RunConfig(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed, lr=args.lr,
                    warmup_steps=args.warmup_steps, lr_decay_steps=args.lr_decay_steps,
                    eval_batches=args.eval_batches).resolved()

    tokenizer = load_tokenizer(run.tokenizer)
    corpus = load_corpus(run.dataset, tokenizer, run.seq_len, run.eval_fraction)
    model = build_model(run.model, tokenizer.vocab_size, run.seq_len, run.seed)
    stream = corpus.stream(run.seed, f"hivemind-{args.shard}", 0)
    eval_batches = corpus.eval_batches(run.eval_batches, run.batch_size) if args.eval_every else []
    dht = start_dht(DHTConfig(initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs)))
    log = AveragingLog()
    logging.getLogger("hivemind").addHandler(log)  # hivemind's loggers stop at its root logger
    clock = dict(adamw=0.0)
    opt = hivemind.Optimizer(
        dht=dht, run_id=args.run_id, params=model.parameters(), optimizer=timed_adamw(run, clock),
        target_batch_size=args.target_batch_size, batch_size_per_step=run.batch_size, use_local_updates=True,
        matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        state_averaging_compression=Float16Compression(),  # the peers' default wire codec: fp16
        load_state_compression=Float16Compression(), delay_state_averaging=args.delay_state_averaging,
        verbose=True,
    )
    print(f"worker up: {dht.peer_id}, epoch {opt.local_epoch}", flush=True)

    epoch, since, compute, steps, losses, taken = opt.local_epoch, time.time(), 0.0, 0, [], 0
    model.train()
    while True:
        start, clock["adamw"] = time.monotonic(), 0.0
        for group in opt.opt.param_groups:  # the peer's schedule (``InnerTrainer.lr_at``)
            group["lr"] = run.lr * min(1.0, (taken + 1) / max(run.warmup_steps or 1, 1)) * run.lr_factor(taken)
        batch = stream.next_batch(run.batch_size)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
        forward_backward = time.monotonic() - start
        opt.step()  # the local AdamW step, progress reports, and at an epoch's end the averaging (background)
        opt.zero_grad(set_to_none=True)
        work = forward_backward + clock["adamw"]
        time.sleep(max(0.0, args.min_step_seconds - work))  # as the peers' pacing: a slower device
        compute += max(work, args.min_step_seconds)
        steps, taken = steps + 1, taken + 1
        losses.append(loss.item())
        if opt.local_epoch != epoch:
            due = args.eval_every and opt.local_epoch % args.eval_every == 0
            evaluated = mean_loss(model, eval_batches) if due else None
            now = time.time()
            groups, failures = log.take()
            record = dict(epoch=opt.local_epoch, time=now, wall_seconds=now - since, compute_seconds=compute,
                          inner_steps=steps, loss=sum(losses) / len(losses), groups=groups, failures=failures,
                          peers_seen=opt.tracker.global_progress.num_peers, eval_loss=evaluated,
                          tokens_total=opt.local_epoch * args.target_batch_size * run.seq_len)
            with open(args.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")
            epoch, since, compute, steps, losses = opt.local_epoch, now, 0.0, 0, []


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        os._exit(130)
