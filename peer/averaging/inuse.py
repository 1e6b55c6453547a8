"""The peers this averager process is exchanging streams with right now: their connections stay open when a ping to
them goes unanswered (``SwarmAverager.drop_connections``).

A thin link's queues hold a ping for seconds behind the bytes being moved, so an unanswered ping there says the link
is busy, not that the connection went stale; and closing a connection takes every stream on it: an all-reduce's, a
joiner's download of a round's result or of the state, a follower's join request.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterable, Iterator, Set


class InUse:
    def __init__(self):
        self._streams: collections.Counter = collections.Counter()  # peer id -> streams open with it

    @contextlib.contextmanager
    def streaming(self, peers: Iterable[str]) -> Iterator[None]:
        """While the block runs, ``peers`` count as in use (a stream with each, or one all-reduce with them all)."""
        peers = list(peers)
        self._streams.update(peers)
        try:
            yield
        finally:
            self._streams.subtract(peers)
            self._streams += collections.Counter()  # drops the peers whose count fell to zero

    def peers(self) -> Set[str]:
        return set(self._streams)
