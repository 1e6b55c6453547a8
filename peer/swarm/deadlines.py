"""Deadlines that follow measured round times, so a frozen groupmate costs seconds, not a fixed guess.

hivemind waits out a fixed ``allreduce_timeout`` for a peer that stopped answering (hivemind issue
#676); measured here, a SIGSTOPped peer stalled the others for all of it. Here the all-reduce deadline
is ``factor`` times the median of the recent all-reduces that succeeded, never below ``floor`` nor
above the configured ceiling; before anything is measured it is the ceiling. A groupmate that sends
nothing for a part deadline (at most the all-reduce deadline) is dropped and the group retries.

Times are kept per unit of payload (``size``: 1 for a pseudo-gradient, 2 when the inner first moment
travels with it), so a round that moves twice the bytes gets twice the time.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Deque


class Deadlines:
    def __init__(self, ceiling: float, floor: float, factor: float, part_ceiling: float, window: int = 8):
        self.ceiling, self.floor, self.factor, self.part_ceiling = ceiling, min(floor, ceiling), factor, part_ceiling
        self.recent: Deque[float] = deque(maxlen=window)

    def observe(self, seconds: float, size: float = 1.0) -> None:
        """Record how long a successful all-reduce of ``size`` took, from group formed to averages received."""
        if seconds > 0:
            self.recent.append(seconds / size)

    def allreduce(self, size: float = 1.0) -> float:
        if not self.recent:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.factor * statistics.median(self.recent) * size))

    def part(self, size: float = 1.0) -> float:
        """How long to wait for the next part from one groupmate."""
        return min(self.part_ceiling, self.allreduce(size))
