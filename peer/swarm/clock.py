"""Time, as the round reads it: the local monotonic clock, the swarm's DHT time, and sleeping.

The round's code takes a ``Clock`` instead of calling ``time`` and hivemind, so an in-process test can run it on a
fake clock that jumps when the code sleeps (``tests/harness/fake.py``).
"""

from __future__ import annotations

import time

from hivemind.utils import get_dht_time


class Clock:
    def monotonic(self) -> float:
        """Seconds on this machine's clock: deadlines of our own."""
        return time.monotonic()

    def dht_time(self) -> float:
        """The swarm's shared time (what records and schedules are written in)."""
        return get_dht_time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
