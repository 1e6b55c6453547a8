"""Where a round lets a test harness in: one protocol, whose product implementation does nothing.

Tests and benchmarks strike a peer at a phase of its round (kill it while it sends, freeze it while it
reduces) or make it misbehave (send NaN); their harness (``tests/harness``) subclasses ``Hooks`` and starts
the peer with it. The product never looks at what a hook does, and ships no fault code.

A ``Hooks`` object travels into the averager process when hivemind forks it, so each process calls its own
copy: ``inner``, ``matchmaking`` and ``checkpoint`` fire in the peer's main process, ``send``, ``reduce`` and
``donor`` in its averager process.
"""

from __future__ import annotations

import torch

INNER = "inner"  # halfway through the round's inner steps
MATCHMAKING = "matchmaking"  # as the peer enters matchmaking
SEND = "send"  # after the peer sent its first part in the all-reduce
REDUCE = "reduce"  # after the peer, as a reducer, received a first part from a groupmate
DONOR = "donor"  # while the peer streams its state to a peer that downloads it
CHECKPOINT = "checkpoint"  # while writing a round's checkpoint: the temporary file is written, not yet renamed
PHASES = (INNER, MATCHMAKING, SEND, REDUCE, DONOR, CHECKPOINT)


class Hooks:
    """The points a harness may act at. Every method is a no-op here."""

    def at(self, phase: str, epoch: int) -> None:
        """This peer reached ``phase`` (one of PHASES) in its round at ``epoch``."""

    def outgoing(self, delta: torch.Tensor) -> None:
        """The pseudo-gradient about to be sent (quantized, error feedback included); a hook may change it in
        place."""
