"""M replicas of one model in one process, sharing nothing but the outer step: DiLoCo as the swarm runs it.

Everything that decides what the swarm computes is the peer's own code: the inner loop (InnerTrainer),
error feedback and the codecs, token weighting, the FMA-free Nesterov outer step and the clamped
momentum alignment. Only the transport is replaced: the reducer's weighted average is written out here
(what ExactAllReduceRunner's reducers compute), followed by the codec round trip of its reply.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List

import torch

from compression import get_codec
from compression.feedback import ErrorFeedback, roundtrip
from peer.config import RunConfig
from peer.data import ByteTokenizer, load_corpus
from peer.flat import FlatLayout
from peer.inner import InnerTrainer
from peer.model import build_model
from peer.outer import nesterov_step


@dataclass
class SimulationResult:
    eval_losses: List[float] = field(default_factory=list)  # held-out loss of G after each evaluated round
    eval_rounds: List[int] = field(default_factory=list)
    tokens: List[int] = field(default_factory=list)  # tokens processed by all replicas, at each evaluation
    train_loss: float = float("nan")


def weighted_average(contributions: List[torch.Tensor], weights: List[float]) -> torch.Tensor:
    """What a reducer computes: sum of w_i * x_i over sum of w_i (then encodes it once for everyone)."""
    total = torch.zeros_like(contributions[0])
    for contribution, weight in zip(contributions, weights):
        total.add_(contribution, alpha=weight)
    return total.div_(sum(weights))


def simulate(run: RunConfig, replicas: int, rounds: int, eval_every: int = 1, seed: int = 0) -> SimulationResult:
    run = run.resolved()
    codec = get_codec(run.compression)
    corpus = load_corpus(run.dataset, ByteTokenizer(), run.seq_len, run.eval_fraction)
    eval_batches = corpus.eval_batches(run.eval_batches, run.batch_size)
    base = build_model(run.model, 256, run.seq_len, seed)
    trainers = [InnerTrainer(copy.deepcopy(base), run, torch.device("cpu")) for _ in range(replicas)]
    streams = [corpus.stream(seed, f"replica-{i}", 0) for i in range(replicas)]
    layout = FlatLayout(trainers[0].params)
    params, momentum = layout.gather(trainers[0].params, layout.empty()), layout.empty()
    feedbacks = [ErrorFeedback(codec, layout.numel, enabled=run.error_feedback) for _ in range(replicas)]
    result, tokens, train_losses = SimulationResult(), 0, []
    for round_index in range(rounds):
        contributions, weights = [], []
        for trainer, stream, feedback in zip(trainers, streams, feedbacks):
            stats = trainer.train(iter(lambda s=stream: s.next_batch(run.batch_size), None), run.inner_steps,
                                  global_step=round_index * run.inner_steps)
            delta = layout.gather(trainer.params, layout.empty())
            torch.sub(params, delta, out=delta)
            feedback.commit(delta)  # delta becomes what this replica sends
            contributions.append(delta)
            weights.append(float(stats.tokens))
            tokens += stats.tokens
            train_losses.append(stats.loss)
        averaged = roundtrip(codec, weighted_average(contributions, weights))  # the reducers' encoded reply
        nesterov_step(params, momentum, averaged, run.outer_lr, run.outer_momentum)
        if run.align_every and (round_index + 1) % run.align_every == 0:
            moments = [roundtrip(codec, layout.gather(t.first_moments(), layout.empty())) for t in trainers]
            aligned = roundtrip(codec, weighted_average(moments, weights))
            for trainer in trainers:
                trainer.load_first_moments([view for _, view in layout.slices(aligned)])
        for trainer in trainers:
            layout.scatter(params, trainer.params)
        if (round_index + 1) % eval_every == 0 or round_index + 1 == rounds:
            result.eval_losses.append(trainers[0].evaluate(eval_batches))
            result.eval_rounds.append(round_index + 1)
            result.tokens.append(tokens)
    result.train_loss = sum(train_losses[-replicas:]) / replicas
    return result
