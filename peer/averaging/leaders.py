"""Which peers a round's matchmaking asks to lead its group: the ones our records name, not the DHT's declarations.

hivemind finds a group's leader through the DHT: each peer declares itself under the round's key, reads the
others' declarations, and asks to join those ranked above it ((expiration, peer id), lowest first). On a DHT
that delivers late, each peer reads a different, partial set of declarations in the window, asks a different
leader, and the peers at one state split into small groups: measured, 16 peers on a DHT 6-19 s late formed groups
of 2-5 that were minorities, 60-90 times a run. Yet every peer at our state already holds the others' records,
and they say who is expected in our group (``decide``'s probe list: the holders of our state, in our group, that
accept connections).

So a peer with a probe list asks those of its expected peers whose id sorts below its own, lowest first, and reads
no declarations; a peer in client mode (behind a NAT: nobody can dial it, so it never leads, and nobody expects it
to) asks all of them. Every peer that read the same records asks the same lowest peer; the lowest one that is in
matchmaking leads, and a lower one that comes later takes its group over (hivemind's own redirect: a
leader that joins a better one sends its followers there). A peer that is not in matchmaking yet refuses at once;
so the list is asked again every RETRY_EVERY seconds, from the lowest. A round without a probe list (a delegates'
cross, a peer that read no records) keeps hivemind's DHT declarations.

hivemind's leader also refuses a follower whose declared window ends before its own, since such a follower could
leave before the group closes. Ranked by id, a leader's window may end later than a follower's (each window counts
from the peer's own planned meeting), so an expected peer is not refused for that: a follower that does leave
first leaves the group before it closes (hivemind drops a follower whose request ended), and is not averaged.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

RETRY_EVERY = 1.0  # seconds between two passes over our better-ranked peers
HOLD = 2.0  # how long one pass's entries stay in hivemind's leader queue (expired entries are dropped unasked)
MARGIN = 0.05  # seconds before our own window's end that a pass's entries expire, so they rank above us


def leader_queue(own: str, expected: Iterable[str], declared: float, now: float,
                 client: bool = False) -> List[Tuple[str, float]]:
    """hivemind leader-queue entries (peer id, expiration) for one pass: the expected peers whose id sorts below
    ``own`` (all of them for a ``client``, which cannot lead), lowest first, each expiring before our own declared
    window (``declared``), so that hivemind ranks them above us, and in this order. Empty once our window is over."""
    better = sorted(peer for peer in set(expected) if client or peer < own)
    expires = min(now + HOLD, declared - MARGIN)
    if expires <= now:
        return []
    step = MARGIN / (2 * max(len(better), 1))
    return [(peer, expires - step * (len(better) - i)) for i, peer in enumerate(better)]


class RecordLeaders:
    """One averager's expected peers this round, and the leader queue it serves hivemind's matchmaking."""

    def __init__(self, own: str, clock: Callable[[], float], client: bool = False):
        self.own, self.client = own, client
        self.expected: frozenset = frozenset()
        self.members: frozenset = frozenset()  # all of our group's expected members (``expected``: those to ask)
        self._first = True  # the first pass of a round is served at once
        self._clock = clock

    def set_round(self, expected: Sequence[str], members: Sequence[str] = ()) -> None:
        self.expected = frozenset(peer for peer in expected if peer != self.own)
        self.members = frozenset(peer for peer in members if peer != self.own)
        self._first = True

    def is_expected(self, peer_id: str) -> bool:
        return peer_id in self.expected

    def is_unexpected(self, peer_id: str) -> bool:
        """A peer that our records do not name as a member of our group this round (False without a list)."""
        return bool(self.members) and peer_id not in self.members

    async def queue(self, declared: float) -> Optional[List[Tuple[str, float]]]:
        """This pass's entries, after RETRY_EVERY seconds unless it is the round's first; None without expected
        peers (hivemind then reads the DHT's declarations)."""
        if not self.expected:
            return None
        if not self._first:
            await asyncio.sleep(RETRY_EVERY)
        self._first = False
        return leader_queue(self.own, self.expected, declared, self._clock(), self.client)
