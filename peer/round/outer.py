"""This peer's side of an outer step: the pseudo-gradient it sends, and the step it takes with the group's average.

``OuterStep.write`` puts delta = G - theta (plus the error-feedback residual, quantized) and, on aligned rounds,
AdamW's first moment into the averager's buffers (``buffers``: the transport's, held while in use).
``OuterStep.take`` applies Nesterov on the average the buffers hold after the all-reduce: bit-identical on every
member, since every member holds the same average, G and m. With ``--fragments F`` both concern the fragment the
round closing our epoch averages (``peer/outer/fragments.py``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, ContextManager, Dict, List

import torch
from diloco_compression.feedback import ErrorFeedback

from peer.config import RunConfig
from peer.outer.fragments import Fragments
from peer.outer.lineage import Lineage
from peer.outer.nesterov import nesterov_step
from peer.outer.state import GlobalState, merge_contributors
from peer.train.flat import FlatLayout
from peer.train.local import LocalModel

logger = logging.getLogger(__name__)


class OuterStep:
    def __init__(self, state: GlobalState, local: LocalModel, layout: FlatLayout, lineage: Lineage,
                 feedback: ErrorFeedback, lock: threading.Lock, run: RunConfig,
                 buffers: Callable[[], ContextManager[List[torch.Tensor]]], outgoing: Callable[[torch.Tensor], None]):
        self.state, self.local, self.layout, self.lineage, self.feedback = state, local, layout, lineage, feedback
        self.lock, self.run, self.buffers, self.outgoing = lock, run, buffers, outgoing
        self.fragments = Fragments(layout.numel, run.fragments)

    def part(self) -> slice:
        """The fragment of the flat vector the round closing our epoch averages (all of it without fragments)."""
        return self.fragments.of(self.state.epoch)

    def outer_lr(self) -> float:
        """The outer lr of the step from our epoch to the next."""
        return self.run.outer_lr_at(self.run.global_step(self.state.epoch))

    def outer_momentum(self) -> float:
        """The outer momentum of that step."""
        return self.run.outer_momentum_at(self.run.global_step(self.state.epoch))

    def write(self, align: bool) -> bool:
        """Our pseudo-gradient (and first moments if ``align``) into the buffers; False if the local model diverged,
        which resets it to the global state."""
        part, whole = self.part(), self.fragments.whole()
        with self.buffers() as tensors:
            delta = tensors[0]  # one fragment long: the whole vector is written straight into it without fragments
            own = self.lineage.own_delta(self.state.params, self.local.gather(delta if whole else self.layout.empty()))
            if align:
                _fill(tensors[1], self.local.gather_moments(tensors[1] if whole else self.layout.empty())[part])
            if torch.isfinite(own).all():
                # what we send: delta + residual, quantized; a shorter last fragment pads with zeros
                _fill(delta, own[part], lambda values, out: self.feedback.fragment(part).quantize(values, out=out))
                self.outgoing(delta)
                return True
        logger.error("the local model diverged (non-finite pseudo-gradient); resetting it to the global state")
        self.local.set(self.state.params)
        return False

    def take(self, gathered: Dict, peer_id: str, aligned: bool, tokens: int) -> bool:
        """The outer step on the average in the buffers (``gathered``: the group's contributions, ours under
        ``peer_id``; ``tokens``: the group's); False, and nothing changed but the residual, if it is not finite."""
        part = self.part()
        sent = self.lineage.own_delta(self.state.params, self.local.gather(self.layout.empty()))[part]
        self.feedback.fragment(part).commit(sent)  # sent becomes what we sent; the residual keeps the rest
        with self.lock, self.buffers() as tensors:
            average = tensors[0][: sent.numel()]
            if not torch.isfinite(average).all():
                return False
            self.lineage.merged(self.state.epoch, sent, gathered[peer_id].tokens, offset=part.start or 0)
            nesterov_step(self.state.params[part], self.state.momentum[part], average, self.outer_lr(),
                          self.outer_momentum())
            if aligned:
                self.local.load_first_moments(tensors[1][: sent.numel()], part)
            self.state.merged = merge_contributors(self.state.merged, gathered, self.state.epoch)
            self.state.epoch += 1
            self.state.tokens_total += tokens
            # theta <- G (with overlap: plus the steps taken since), in the fragment the step changed
            self.local.set(self.state.params, part)
        return True

    def eager_target(self) -> torch.Tensor:
        """With overlap, where the next round starts: the outer step we would take with our own pseudo-gradient
        (from theta as frozen at the round's end) in place of the group's average (peer/train/local.py). With
        fragments, only the fragment the round averages takes that step; the rest of theta trains on as it is."""
        part, theta = self.part(), self.local.gather(self.layout.empty())
        params, momentum = self.state.params[part].clone(), self.state.momentum[part].clone()
        nesterov_step(params, momentum, torch.sub(params, theta[part]), self.outer_lr(), self.outer_momentum())
        theta[part] = params
        return theta

    def drop_unmerged(self) -> None:
        """Past the staleness bound: forget our unmerged work and train from the global state again."""
        with self.lock:
            self.local.set(self.state.params)
            self.lineage.drop()


def _fill(buffer: torch.Tensor, values: torch.Tensor, write=lambda values, out: out.copy_(values)) -> None:
    """``buffer`` <- ``values`` (one fragment, maybe shorter than the buffer), zeros after them."""
    write(values, buffer[: values.numel()])
    buffer[values.numel():].zero_()
