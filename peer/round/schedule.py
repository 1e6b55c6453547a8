"""When a round's inner phase ends, so that peers holding the same state reach matchmaking together.

- After an outer step the group already agrees: its members shared their pace in the all-reduce and
  all computed the same length for the next round (``peer.swarm.timing.next_round_seconds``).
- A peer without that agreement (a joiner, or one that missed its group and caught up) lines up with
  the plans that the peers holding its state published in their records (``timing.round_target``).
  If it adopts the state while they are syncing it, it ends its round at once and joins them: they expect it
  (its record said it was downloading their state), and a round of its own would end after their group closed.
  Until it finds such plans it keeps training and keeps looking: once the swarm moves on, it catches
  up mid-round (keeping its work) and takes the swarm's end time as its own.

Within the deadline a faster peer may do up to 2H steps and a slower one fewer, so nobody idles at
matchmaking; a peer alone does exactly H steps. A round begun before any pace is known plans by the pace of its first
steps (``RoundClock._first_plan``), so that a swarm started together meets together. A round the group stretched
to outlast its syncs (overlap on a thin link) allows as many more. (With fragments, H/F steps in place of H:
``RunConfig.round_steps``.)
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from peer.config import RunConfig
from peer.round.announce import Announcer
from peer.round.catchup import StateCatchUp
from peer.swarm.clock import Clock
from peer.swarm.consensus import peers_with_state, syncing_now
from peer.swarm.records import RecordCache
from peer.swarm.timing import round_target

WATCH_INTERVAL = 1.0  # seconds between looks at the swarm while a round is not lined up
FIRST_PLAN_STEPS = 3  # steps a peer that knows no pace yet takes to learn one, before it plans its round by it


class RoundClock:
    def __init__(self, run: RunConfig, catchup: StateCatchUp, cache: RecordCache, announcer: Announcer,
                 answered: threading.Event, clock: Clock, publish: Callable[[Optional[float]], None]):
        self.run, self.catchup, self.cache, self.announcer, self.clock = run, catchup, cache, announcer, clock
        self.answered = answered  # a peer gone silent answered a ping (a healed partition, say)
        self.publish = publish
        self.step_seconds: Optional[float] = None  # EMA of this peer's seconds per inner step
        self.stretch = 1.0  # the group's last agreed round length over its planned one (``timing.next_round``)
        self.agreed_end: Optional[float] = None  # DHT time at which the group agreed the next round ends
        self.deadline: Optional[float] = None  # monotonic time the current inner phase ends, if any
        self.began = 0.0  # monotonic time the current inner phase began
        self.target: Optional[float] = None  # the same in DHT time (what we tell our group with overlap)
        self.aligned = False
        self.following = False  # lined up with holders that were syncing: their next state is to be replayed
        self.rebased = False
        self._last_watch = 0.0
        self.sync_in_flight: Callable[[], bool] = lambda: False  # overlap: a sync runs in the background
        # overlap: set once ``begin`` has planned the round that trains during the sync just launched, whose
        # planned end that sync tells its group
        self.planned = threading.Event()

    def begin(self) -> int:
        """Plan the next inner phase; returns the step budget. Catches up first if the swarm moved on."""
        # with overlap, the sync in flight catches up itself; two at once would both rebase
        self.rebased = not self.sync_in_flight() and self.catchup.catch_up(timeout=60.0).adopted
        now = self.clock.dht_time()
        target = self.agreed_end if self.agreed_end and self.agreed_end > now and not self.rebased else None
        self.agreed_end = None
        self.aligned, self.following = target is not None, False
        if target is None:
            # a plan that ends with the round we just ended (within a grace window) is that round's, by a peer that
            # has not begun its next one: lined up with, it made our next round one step long (with overlap, after
            # a sync that failed, its successor waited a whole round in matchmaking)
            ended = self.target is not None and not self.rebased
            target = self._target_from_records(now, self.target + self.run.grace_seconds if ended else now)
        self.publish(target if target is not None else self._own_plan(now))
        self._set_deadline(target, now)
        self.began = self.clock.monotonic()
        self.planned.set()
        if target is None:
            return self.run.round_steps
        return 10**9 if self.run.round_seconds else round(2 * self.run.round_steps * self.stretch)

    def over(self, steps_done: int) -> bool:
        """Stop before a step that would end after the round's planned end: a peer reaches its group's matchmaking
        early by at most one of its steps, never late by one, however slow its steps are (the window waits for the
        planned end: ``Synchronizer.sync``'s ``meet_at``)."""
        if steps_done == 0 or self.deadline is None:
            return False
        now = self.clock.monotonic()
        pace = self.step_seconds or (now - self.began) / steps_done
        return now + pace > self.deadline

    def watch(self, steps_done: int = 0) -> None:
        """Called between inner steps: an unaligned peer looks for the swarm's schedule and catches up; so does an
        aligned one once a peer gone silent answers a ping (a healed partition: the other side's state may win), and
        one that lined up with holders in a sync (``following``): it catches up as soon as their sync ends, so that
        it meets them next with the state they will average from. A round begun with no pace known has no plan
        until ``steps_done`` tell one (``_first_plan``)."""
        news = self.answered
        if (self.aligned and not self.following and not news.is_set()) or self.sync_in_flight() or \
                self.clock.monotonic() - self._last_watch < WATCH_INTERVAL:
            return
        self._last_watch = self.clock.monotonic()
        if self.target is None and self.step_seconds is None and steps_done >= FIRST_PLAN_STEPS:
            self._first_plan(steps_done)
        heard = news.is_set()
        news.clear()
        # news (a healed partition) is worth waiting for a fresh lookup: it comes once, and an aligned peer does not
        # look again. The routine looks poll, as a lookup in the background brings the records: a look that waited
        # for its lookup, every second of a round not lined up, stalled training by the lookup's round trips each
        # time (a first round took 104-143 s for 100 steps of 1 s in ``bench.scale``, and its groups met scattered)
        if self.catchup.catch_up(timeout=60.0, poll=not heard).adopted:
            self.rebased, self.following = True, False
            if self.catchup.holders_syncing():
                # they may be waiting for us: end the round now and join them. Our published plan stays as it
                # was: a plan of "now" would draw others' rounds (the median of plans) short too
                self.aligned = True
                now = self.clock.dht_time()
                self._set_deadline(now, now)
                return
        elif self.aligned:  # our state still wins: our group's plan stands
            now, mine = self.clock.dht_time(), self.announcer.record()
            # their sync ended without a new state (or they are gone): nothing more to follow this round
            self.following = self.following and bool(syncing_now(self.cache.records.values(), mine, now))
            return
        now = self.clock.dht_time()
        records, mine = self.cache.records.values(), self.announcer.record()
        others = [r for r in peers_with_state(records, mine, now) if r.next_sync_at and r.next_sync_at > now]
        if others:
            target = round_target(records, mine, None, now)
            # with overlap, holders in a sync will hold its result when they meet next: a peer that missed their
            # group replays it then, or it meets them one epoch behind, round after round (the hard row)
            self.aligned, self.following = True, bool(syncing_now(records, mine, now))
            self.publish(target)
            self._set_deadline(target, now)

    def realign(self) -> None:
        """The round in progress should line up with the swarm's schedule (``watch`` will look for it)."""
        self.aligned = False
        self._last_watch = 0.0

    def retarget(self, end: float) -> None:
        """Overlap, from the sync thread once the group agreed: the round in progress ends at ``end`` (DHT time)."""
        self.aligned = True
        self._set_deadline(end, self.clock.dht_time())

    def plan(self) -> Optional[float]:
        """The end of the round in progress, as our record tells it. One already passed (a sync that overran the
        round retargeted it there) is at most a step away: the round ends at its next step. Published as it is,
        the stale end made others take us for silent, a peer past its planned sync without a word
        (``consensus.responsive``), and close the group we were about to join without us (bench/scale.py, 16
        peers, 4 of them at 6-s steps)."""
        if self.target is None:
            return None
        now = self.clock.dht_time()
        return self.target if self.target > now else now + (self.step_seconds or 0.0)

    def finish(self, steps: int, compute_seconds: float, next_round_seconds: Optional[float],
               anchor: Optional[float] = None, stretch: float = 1.0,
               ended: Optional[float] = None) -> Optional[str]:
        """After the round's sync: update our pace and keep the group's agreed end for the next round, counted
        from ``anchor`` (overlap: the group's agreed end of the round that just ended) or else from now. With
        overlap, a sync that ``ended`` (DHT time) after that end counts from its own end: the round after it
        starts only then, and counted from the agreed end it would lose what the sync overran, round after round.
        ``stretch``: that round's length over its planned one; its step budget grows with it. Returns a line for
        the user when the group begins or stops stretching its rounds (``timing.next_round``)."""
        change = None
        if next_round_seconds and (stretch > 1.0) != (self.stretch > 1.0):  # a group's agreement, not an adoption
            change = (f"syncs take longer than a round: the group stretched the next one to {next_round_seconds:.0f} s "
                      f"({stretch:.2f}x its planned length), so that its sync ends inside it" if stretch > 1.0 else
                      f"syncs fit inside a round again: the next one lasts its planned {next_round_seconds:.0f} s")
        if next_round_seconds:
            self.stretch = stretch
        if steps:
            # an EMA weighted by the round's share of H, so that one short round does not skew the pace
            seconds, weight = compute_seconds / steps, 0.5 * min(1.0, steps / self.run.round_steps)
            self.step_seconds = seconds if self.step_seconds is None else \
                (1 - weight) * self.step_seconds + weight * seconds
        if anchor is not None and ended is not None:
            anchor = max(anchor, ended)
        self.agreed_end = (anchor or self.clock.dht_time()) + next_round_seconds if next_round_seconds else None
        return change

    def _first_plan(self, steps_done: int) -> None:
        """Plan a round begun with no pace known (a swarm's first): H steps at the pace of those so far, published, so
        that the peers at our state line up with it, and we with theirs. Without it, peers that began together each did
        their H steps and came to matchmaking as their speeds fell, minutes apart with steps 1-10 s long: 72 of 256
        first syncs found no group in ``bench.scale``, and 265 of 1024."""
        now = self.clock.dht_time()
        pace = (self.clock.monotonic() - self.began) / steps_done
        target = now + max(self.run.round_steps - steps_done, 0) * pace
        self.publish(target)
        self._set_deadline(target, now)

    def _own_plan(self, now: float) -> Optional[float]:
        pace = self.run.seconds_per_round or (self.step_seconds * self.run.round_steps if self.step_seconds else None)
        return now + pace if pace else None

    def _target_from_records(self, now: float, after: float) -> Optional[float]:
        """Line up with the plans of the peers at our state that end after ``after``."""
        records, mine, after = self.cache.records.values(), self.announcer.record(), max(now, after)
        holders = peers_with_state(records, mine, now)
        if holders:
            self.aligned = any(r.next_sync_at and r.next_sync_at > after for r in holders)
            return round_target(records, mine, self._own_plan(now), now, after=after)
        self.aligned = True  # nobody else holds our state: there is no one to line up with
        return self._own_plan(now) if self.run.round_seconds else None

    def _set_deadline(self, target: Optional[float], now: float) -> None:
        self.target = target
        self.deadline = None if target is None else self.clock.monotonic() + (target - now)
