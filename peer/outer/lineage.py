"""This peer's unmerged work across a change of lineage: what a rebase keeps, carries or drops.

A peer that adopts another state (it caught up, lost a fork, or restarted) rebases its local model onto it. What
happens to its own work depends on what the new state already holds of it (its ``merged`` record of our epochs):

- ``OURS_MERGED``: the new state merged the delta we just attempted (our group finished without us): our delta is
  in, theta <- G_new, and sending it again would count it twice;
- ``RESUMED_MERGED``: it merged the work this peer resumed from its checkpoint (the process died after its group
  merged the round, before the round's checkpoint): that work is dropped, theta <- G_new;
- ``KEEP_WORK``: theta <- G_new - (G - theta), keeping the round's work; our own earlier deltas that only the
  lineage we leave merged are carried (``carried``) into our next contribution, with their tokens. (Shifting
  theta by them instead once started a round several rounds' work away from any trained point: its loss jumped
  from 2.65 to 4.78.)
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from peer.outer.contributions import Contributions


class Rebase(enum.Enum):
    OURS_MERGED = "ours_merged"
    RESUMED_MERGED = "resumed_merged"
    KEEP_WORK = "keep_work"


def rebase_kind(our_last_merged: int, attempted_epoch: Optional[int], resumed_epoch: Optional[int]) -> Rebase:
    """``our_last_merged``: the last epoch at which the new state merged one of our deltas (-1: never).
    ``attempted_epoch``: we just sent our delta in an all-reduce at this epoch that failed for us.
    ``resumed_epoch``: a restart's unmerged work was trained on G at this epoch, not yet sent or found merged."""
    if attempted_epoch is not None and our_last_merged == attempted_epoch:
        return Rebase.OURS_MERGED
    if resumed_epoch is not None and our_last_merged >= resumed_epoch:
        return Rebase.RESUMED_MERGED
    return Rebase.KEEP_WORK


class Lineage:
    """Our recent contributions, the deltas carried from a fork we left, and a restart's resumed work."""

    def __init__(self, contributions: Contributions, carried: Optional[torch.Tensor] = None,
                 recovered_tokens: int = 0, resumed_epoch: Optional[int] = None):
        self.contributions = contributions
        self.carried = carried  # our deltas that only a lineage we left merged: sent with our next contribution
        self.recovered_tokens = recovered_tokens  # the tokens behind them, not yet re-sent
        self.resumed_epoch = resumed_epoch  # a restart's unmerged work was trained on G at this epoch
        self.dropped_resumed = False  # an adoption found that work merged already: the caller drops it, once

    def take_resumed_epoch(self) -> Optional[int]:
        epoch, self.resumed_epoch = self.resumed_epoch, None
        return epoch

    def rebase(self, kind: Rebase, our_last_merged: int, new_params: torch.Tensor, part: slice = slice(None)) -> None:
        """Onto a new lineage (the local model moves as ``kind`` says; the caller moves it). ``part``: the fragment
        whose outer step merged our work (with ``--fragments``)."""
        if kind is Rebase.OURS_MERGED:
            if self.carried is not None and part != slice(None):
                self.carried[part] = 0  # what we carry in the other fragments has not gone out yet
            else:
                self.carried = None
        elif kind is Rebase.RESUMED_MERGED:
            self.dropped_resumed = True
            self.carried, self.recovered_tokens = None, 0
        elif self.contributions.unmerged(our_last_merged):
            if self.carried is None:
                self.carried = torch.zeros_like(new_params)
            self.recovered_tokens += self.contributions.carry_into(self.carried, our_last_merged)
        self.contributions.clear()

    def own_delta(self, params: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """Our unmerged work, written over ``theta``: G - theta, plus the deltas we carry."""
        torch.sub(params, theta, out=theta)
        if self.carried is not None:
            theta.add_(self.carried)
        return theta

    def merged(self, epoch: int, sent: torch.Tensor, tokens: int, offset: int = 0) -> None:
        """Our contribution ``sent`` (carried deltas included) was merged into the outer step at ``epoch``. With
        fragments it is one fragment of the flat vector, from ``offset`` on: only that part of what we carry went
        out with it."""
        self.contributions.remember(epoch, sent, tokens, offset)
        self.resumed_epoch = None  # sent and merged, whatever a restart resumed with
        if self.carried is not None and sent.numel() < self.carried.numel():
            self.carried[offset: offset + sent.numel()] = 0
        else:
            self.carried = None

    def drop(self) -> None:
        """Past the staleness bound: forget our unmerged work."""
        self.contributions.clear()
        self.carried = None

    def take_recovered_tokens(self) -> int:
        """Tokens of our work carried over from a losing fork: the caller adds them to its next contribution."""
        tokens, self.recovered_tokens = self.recovered_tokens, 0
        return tokens

    def return_tokens(self, tokens: int) -> None:
        """A sync that took carried tokens did not apply: they are still carried."""
        self.recovered_tokens += tokens

    def take_dropped_resumed(self) -> bool:
        """Did an adoption find the work we resumed from a checkpoint merged already? Once."""
        dropped, self.dropped_resumed = self.dropped_resumed, False
        return dropped
