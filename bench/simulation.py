"""M replicas of one model in one process, sharing nothing but the outer step: DiLoCo as the swarm runs it.

Everything that decides what the swarm computes is the peer's own code: the inner loop (InnerTrainer),
error feedback and the codecs, token weighting, the reducers' robust mean, the FMA-free Nesterov outer
step and the clamped momentum alignment. Only the transport is replaced: each reducer's span of the
vector is combined here with ``peer.averaging.robust.robust_mean`` (what ExactAllReduceRunner's reducers run on
their parts), followed by the codec round trip of its reply.

With ``run.fragments`` F > 1, a round is H/F inner steps and averages one fragment of the vector
(``peer/outer/fragments.py``), as the peers do. With ``overlap`` (a fraction of a round), each round's average
lands that far into the next round, as with the peers' ``--overlap``: the next round starts from the eager outer
step (each replica's own delta in place of the average), and when the average lands each replica is shifted by
the difference, keeping the steps taken since (``peer/train/local.py``). The held-out loss is always G's.

``data_parallel`` is the baseline: synchronous data-parallel training, the replicas' gradients averaged
every step, on the same data streams, with the same inner loop and schedule.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import torch
from diloco_compression import Codec, get_codec
from diloco_compression.feedback import CHUNK_VALUES, ErrorFeedback, roundtrip

from peer.averaging.robust import robust_mean
from peer.config import RunConfig
from peer.outer.fragments import Fragments
from peer.outer.nesterov import nesterov_step
from peer.train.data import load_corpus
from peer.train.flat import FlatLayout
from peer.train.inner import InnerTrainer
from peer.train.model import build_model
from peer.train.tokenizer import ByteTokenizer


@dataclass
class SimulationResult:
    eval_losses: List[float] = field(default_factory=list)  # held-out loss of G after each evaluated round
    eval_rounds: List[int] = field(default_factory=list)  # rounds (data-parallel: steps) done at each evaluation
    tokens: List[int] = field(default_factory=list)  # tokens processed by all replicas, at each evaluation
    bytes_sent: List[int] = field(default_factory=list)  # encoded bytes one replica sent (mean), at each evaluation
    initial_loss: float = float("nan")  # held-out loss of the initial model
    train_loss: float = float("nan")  # mean training loss of the replicas' last round (or last steps)

    def record(self, loss: float, rounds: int, tokens: int, bytes_sent: float) -> None:
        self.eval_losses.append(loss)
        self.eval_rounds.append(rounds)
        self.tokens.append(tokens)
        self.bytes_sent.append(int(bytes_sent))


def encoded_bytes(codec: Codec, values: torch.Tensor) -> int:
    """Length of the codec's encoding of ``values``, chunked as the error feedback and the wire chunk them."""
    return sum(len(codec.encode(values[start: start + CHUNK_VALUES]))
               for start in range(0, values.numel(), CHUNK_VALUES))


def reduce(contributions: Sequence[torch.Tensor], weights: Sequence[float], clip_factor: float) -> torch.Tensor:
    """What the group's reducers compute: the butterfly gives each of the M members one contiguous span of
    the vector (one part each at these sizes: parts are 1 MiB of encoded values), and each combines its
    span with the peer's robust weighted mean (with every member honest, the plain weighted mean unless
    a contribution lies past ``clip_factor`` median deviations)."""
    size, members = contributions[0].numel(), len(contributions)
    bounds = [size * index // members for index in range(members + 1)]
    averaged = torch.empty_like(contributions[0])
    for start, end in zip(bounds, bounds[1:]):
        parts = {sender: (contribution[start:end], weight)
                 for sender, (contribution, weight) in enumerate(zip(contributions, weights))}
        averaged[start:end] = robust_mean(parts, clip_factor)[0]
    return averaged


def round_steps(inner_steps: int, paces: Sequence[float]) -> List[int]:
    """Inner steps of each replica in one round, as the swarm schedules it (README, "What a round does"): a
    round lasts H steps at the median member's pace (seconds per step), so a replica ``pace`` times slower
    than the median does about H / pace steps; at least 1, at most 2H (peer/round/schedule.py)."""
    length = inner_steps * statistics.median(paces)
    return [min(2 * inner_steps, max(1, -int(-length // pace))) for pace in paces]


def batches(stream, batch_size: int) -> Iterator[torch.Tensor]:
    return iter(lambda: stream.next_batch(batch_size), None)


def together(streams, batch_size: int) -> Iterator[torch.Tensor]:
    """A data-parallel step's data: a batch from every replica's stream, one micro-batch each (an InnerTrainer
    with ``micro_batch=batch_size`` accumulates loss / M over them: the average of the M gradients)."""
    return iter(lambda: torch.cat([stream.next_batch(batch_size) for stream in streams]), None)


def warm_start(trainers: Sequence[InnerTrainer], streams, batch_size: int, steps: int) -> int:
    """``steps`` data-parallel steps on the first replica; then every replica takes its weights and AdamW state
    (DiLoCo's experiments start from a pretrained model). Returns the tokens trained on."""
    lead = trainers[0]
    stats = lead.train(together(streams, batch_size), steps, global_step=0)
    for trainer in trainers[1:]:
        trainer.model.load_state_dict(lead.model.state_dict())
        trainer.optimizer.load_state_dict(copy.deepcopy(lead.optimizer.state_dict()))  # no shared moments
        trainer.local_steps = lead.local_steps
    return stats.tokens


def simulate(run: RunConfig, replicas: int, rounds: int, eval_every: int = 1, seed: int = 0,
             paces: Optional[Sequence[float]] = None,
             schedule: Optional[Sequence[Sequence[int]]] = None, warm_steps: int = 0,
             observe: Optional[Callable[[str, torch.Tensor], None]] = None, overlap: float = 0.0
             ) -> SimulationResult:
    """``rounds`` outer rounds of ``replicas`` replicas; ``paces``: each replica's seconds per inner step
    (default: all equal), which sets its steps and so its tokens and weight in every round. ``schedule``
    instead gives the steps of every replica in every round (``schedule[round][replica]``), e.g. the steps
    that real peers' metrics report, to replay their run. ``warm_steps``: data-parallel steps first
    (``warm_start``), evaluated as round 0. ``observe(kind, values)`` sees every vector a replica sends, as it
    encodes it: kind "delta" (its pseudo-gradient) or "moment" (its first moments, for alignment)."""
    run = run.resolved()
    codec = get_codec(run.compression)
    corpus = load_corpus(run.dataset, ByteTokenizer(), run.seq_len, run.eval_fraction)
    eval_batches = corpus.eval_batches(run.eval_batches, run.batch_size)
    base = build_model(run.model, ByteTokenizer.vocab_size, run.seq_len, seed)
    trainers = [InnerTrainer(copy.deepcopy(base), run, torch.device("cpu")) for _ in range(replicas)]
    streams = [corpus.stream(seed, f"replica-{i}", 0) for i in range(replicas)]
    schedule = schedule or [round_steps(run.round_steps, paces or [1.0] * replicas)] * rounds
    layout = FlatLayout(trainers[0].params)
    fragments = Fragments(layout.numel, run.fragments)  # a round averages one of them (all of it without fragments)
    params, momentum = layout.gather(trainers[0].params, layout.empty()), layout.empty()
    feedbacks = [ErrorFeedback(codec, layout.numel, enabled=run.error_feedback) for _ in range(replicas)]
    evaluator = InnerTrainer(copy.deepcopy(base), run, torch.device("cpu"))
    landing: List[Optional[torch.Tensor]] = [None] * replicas  # overlap: each replica's shift when the average lands

    def evaluate() -> float:
        """G's held-out loss (with fragments or overlap a replica's theta is not G)."""
        layout.scatter(params, evaluator.params)
        return evaluator.evaluate(eval_batches)

    def land(index: int, step: int = 0, count: int = 0) -> None:
        """Overlap: the last round's average reaches replica ``index`` ``overlap`` of the way into this round."""
        if landing[index] is not None and step >= overlap * count:
            layout.add_into(landing[index], trainers[index].params)
            landing[index] = None

    result = SimulationResult(initial_loss=evaluate())
    tokens, sent, train_losses = 0, 0, []
    if warm_steps:
        tokens = warm_start(trainers, streams, run.batch_size, warm_steps)
        sent = replicas * warm_steps * get_codec("none").wire_bytes(layout.numel)  # each an fp32 gradient a step
        layout.gather(trainers[0].params, params)
        result.record(evaluate(), 0, tokens, sent / replicas)
    for round_index in range(rounds):
        contributions, weights = [], []
        global_step = warm_steps + run.global_step(round_index)
        part = fragments.of(round_index)
        for index, (trainer, stream, feedback, count) in enumerate(zip(trainers, streams, feedbacks,
                                                                       schedule[round_index])):
            stats = trainer.train(batches(stream, run.batch_size), count, global_step=global_step,
                                  on_step=lambda step, *_: land(index, step, count))
            land(index)  # a round shorter than the sync: it lands at the round's end
            delta = layout.gather(trainer.params, layout.empty())
            torch.sub(params, delta, out=delta)
            delta = delta[part]
            feedback.fragment(part).commit(delta)  # delta becomes what this replica sends
            sent += encoded_bytes(codec, delta)
            if observe:
                observe("delta", delta)
            contributions.append(delta)
            weights.append(float(stats.tokens))  # token weighting (docs/design.md, step 2)
            tokens += stats.tokens
            train_losses.append(stats.loss)
        averaged = roundtrip(codec, reduce(contributions, weights, run.clip_factor))  # the reducers' encoded reply
        before, before_momentum = params[part].clone(), momentum[part].clone()
        nesterov_step(params[part], momentum[part], averaged, run.outer_lr_at(global_step),
                      run.outer_momentum_at(global_step))
        if run.align_every and (round_index // fragments.count + 1) % run.align_every == 0:
            moments = [layout.gather(t.first_moments(), layout.empty())[part] for t in trainers]
            sent += sum(encoded_bytes(codec, moment) for moment in moments)
            for moment in moments if observe else ():
                observe("moment", moment)
            moments = [roundtrip(codec, moment) for moment in moments]
            aligned = roundtrip(codec, reduce(moments, weights, run.clip_factor))
            for trainer in trainers:
                whole = layout.gather(trainer.first_moments(), layout.empty())
                whole[part] = aligned
                trainer.load_first_moments([view for _, view in layout.slices(whole)])
        for index, trainer in enumerate(trainers):  # theta <- G in the fragment averaged; the rest keeps its work
            theta = layout.gather(trainer.params, layout.empty())
            if overlap:  # the next round starts from the eager step: this replica's own delta in place of the average
                start, mine = before.clone(), before_momentum.clone()
                nesterov_step(start, mine, before - theta[part], run.outer_lr_at(global_step),
                              run.outer_momentum_at(global_step))
                theta[part] = start
                landing[index] = torch.zeros_like(theta)
                landing[index][part] = params[part] - start
            else:
                theta[part] = params[part]
            layout.scatter(theta, trainer.params)
        if (round_index + 1) % eval_every == 0 or round_index + 1 == rounds:
            result.record(evaluate(), round_index + 1, tokens, sent / replicas)
    result.train_loss = sum(train_losses[-replicas:]) / replicas
    return result


def data_parallel(run: RunConfig, replicas: int, steps: int, eval_every: int = 1, seed: int = 0) -> SimulationResult:
    """Synchronous data-parallel training for ``steps`` steps: each step, every replica takes a batch from its
    own stream and the replicas' gradients are averaged (``together``) before one clipped AdamW step. Each
    replica sends its full fp32 gradient every step."""
    run = run.resolved()
    corpus = load_corpus(run.dataset, ByteTokenizer(), run.seq_len, run.eval_fraction)
    eval_batches = corpus.eval_batches(run.eval_batches, run.batch_size)
    model = build_model(run.model, ByteTokenizer.vocab_size, run.seq_len, seed)
    trainer = InnerTrainer(model, run, torch.device("cpu"), micro_batch=run.batch_size)
    streams = [corpus.stream(seed, f"replica-{i}", 0) for i in range(replicas)]
    gradient_bytes = get_codec("none").wire_bytes(sum(p.numel() for p in trainer.params))
    data = together(streams, run.batch_size)
    result = SimulationResult(initial_loss=trainer.evaluate(eval_batches))
    done = tokens = 0
    while done < steps:
        stats = trainer.train(data, min(eval_every, steps - done), global_step=done)
        done, tokens = done + stats.steps, tokens + stats.tokens
        result.record(trainer.evaluate(eval_batches), done, tokens, done * gradient_bytes)
        result.train_loss = stats.loss
    return result
