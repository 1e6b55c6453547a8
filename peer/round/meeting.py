"""When a sync meets its group: the round's planned meeting time, the window past it, and the waits around it.

A peer ends its inner phase at the last step that ends by the round's planned end (``RoundClock.over``), so it is
early, never late, and its group's matchmaking window runs from that meeting time (``meet_at``), not from its own
arrival: a slow peer's last step costs nobody a group. ``Meeting.arrive`` is what a sync does before it looks at
the records: far ahead of the meeting it sleeps until a window before it, and late for it it first waits for the
members of its last group. The window (``grace``) is longer on a link whose syncs are long, and on a DHT that
delivers late; ``observe`` keeps the lengths of this peer's syncs that applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from peer.round.catchup import StateCatchUp
from peer.swarm.clock import Clock
from peer.swarm.records import RecordCache
from peer.swarm.timing import matchmaking_grace

LATE_SLACK = 1.0  # seconds past its planned meeting at which a sync counts as late (its last one overran)


@dataclass(frozen=True)
class Arrival:
    """How a sync came to its meeting: seconds slept until a window before it, seconds early still after that (the
    sync's budget is longer by these), and seconds spent waiting for a late one's last groupmates."""

    slept: float = 0.0
    early: float = 0.0
    awaited: float = 0.0


class Meeting:
    def __init__(self, clock: Clock, catchup: StateCatchUp, cache: RecordCache, peer_id: str, grace_seconds: float):
        self.clock, self.catchup, self.cache, self.peer_id = clock, catchup, cache, peer_id
        self.grace_seconds = grace_seconds
        # how long the attempts that applied took, from their start to the outer step (a moving average; not the
        # catch-up before them, nor failed attempts); told to the group with overlap
        self.sync_seconds: Optional[float] = None
        self.last_group: Tuple[str, ...] = ()  # the members of the last group whose round we applied

    def grace(self) -> float:
        """The matchmaking window past the planned meeting: longer on a link whose syncs are long, and on a DHT that
        delivers late."""
        return matchmaking_grace(self.grace_seconds, self.sync_seconds, self.cache.lag)

    def arrive(self, meet_at: Optional[float]) -> Arrival:
        """Come to the meeting at ``meet_at`` (DHT time; None: there is none, meet now)."""
        early = max(0.0, meet_at - self.clock.dht_time()) if meet_at is not None else 0.0
        slept = max(0.0, early - self.grace())
        if slept:
            # far ahead of the meeting (a fast peer, or a sync launched as its next round began): the records read now
            # would be stale by then, and a group's leader closes it at the count it expects, so a holder it missed
            # met nobody. Read them, and join, a window before the meeting
            self.clock.sleep(slept)
            early -= slept
        late = meet_at is not None and self.clock.dht_time() > meet_at + LATE_SLACK
        awaited = 0.0
        if late and self.last_group:
            # they got the last round's parts seconds apart: read at once, their records show them behind us, and
            # we would form a group without them (a minority of 2, every other round on a 1 Mbit/s link)
            began = self.clock.monotonic()
            self.catchup.await_members(set(self.last_group) - {self.peer_id}, began + self.grace())
            awaited = self.clock.monotonic() - began
        return Arrival(slept, early, awaited)

    def observe(self, group: Optional[Tuple[str, ...]], averaging_seconds: Optional[float]) -> None:
        """A sync ended: ``group``, the members of the round it applied (None: it applied none); ``averaging_seconds``,
        its attempt that applied, from its start (``timing.next_round``, ``timing.matchmaking_grace``)."""
        if group is not None:
            self.last_group = group
        if averaging_seconds is not None:
            self.sync_seconds = averaging_seconds if self.sync_seconds is None else \
                0.5 * (self.sync_seconds + averaging_seconds)
