"""A round of many groups, past our group's all-reduce (``peer/swarm/grouping.py``; docs/design.md, "Rounds of many
groups"): as our group's delegate, the cross-group all-reduce of our group's average; as any other member, the
round's result from the delegates. ``Synchronizer`` calls these for ``decide``'s CROSS and RECEIVE actions; each
returns the facts of the next view (``Phase.CROSSED``, ``Phase.RECEIVED``). ``attempt`` is the sync's running
``_Attempt`` (``round/sync.py``), whose ``group``, ``group_average``, ``crossed`` and ``averaged`` they set.
"""

from __future__ import annotations

from typing import Callable

from dht.errors import first_line
from peer.averaging.averager import CROSS
from peer.config import RunConfig
from peer.round.announce import Announcer
from peer.round.decide import Action, Failure, Phase, classify
from peer.swarm.clock import Clock
from peer.swarm.deadlines import Deadlines
from peer.swarm.metadata import Averaged, Contribution, Delegation


class Crossing:
    def __init__(self, transport, clock: Clock, announcer: Announcer, deadlines: Deadlines, run: RunConfig,
                 moved_on: Callable[[], bool] = lambda: False):
        self.transport, self.clock, self.announcer, self.deadlines, self.run = \
            transport, clock, announcer, deadlines, run
        # a fresh look at the records: does a live peer hold a better state? Then the round our delegate waits for
        # ended without our group (a late group's delegate meets nobody), and it stops waiting
        self.moved_on = moved_on

    def _alone(self, contribution: Contribution, attempt) -> Averaged:
        """A group of one: our own delta, in the buffers, is its average."""
        attempt.group_average = None
        return Averaged(gathered={self.announcer.identity.peer_id: contribution}, aligned=attempt.align, seconds=0.0)

    def cross(self, action: Action, attempt, contribution: Contribution) -> dict:
        """As our group's delegate: the cross-group all-reduce of our group's average, weighted by its members'."""
        if attempt.group is None:  # nobody else meets in our group this round
            attempt.group = self._alone(contribution, attempt)
        mine, size = self.announcer.record(), 1 + attempt.align
        delegation = Delegation(epoch=mine.epoch, hash=mine.state_hash, align=attempt.align,
                                members=attempt.group.gathered)
        self.restore(attempt)  # a retry starts from our group's average again
        attempt.crosses, attempt.crossed, attempt.started = attempt.crosses + 1, (mine.epoch, mine.state_hash), \
            self.clock.monotonic()
        try:
            # the first cross waits for the slowest group the round's first attempt allows: its window, its all-reduce
            meet_at = None if attempt.meet_at is None or attempt.crosses > 1 else \
                attempt.meet_at + self.run.grace_seconds + self.deadlines.allreduce(size)
            self.transport.prepare(mine.epoch, mine.state_hash, 2, max(2, action.expected),
                                   allreduce_timeout=self.deadlines.allreduce(size),
                                   part_timeout=self.deadlines.part(size), probe=(), phase=CROSS, meet_at=meet_at)
            attempt.averaged = self.transport.average(delegation, delegation.weight(),
                                                      timeout=attempt.deadline - self.clock.monotonic(),
                                                      abandon=self.moved_on)
        except Exception as e:
            attempt.detail = first_line(e)
            return dict(phase=Phase.CROSSED, failure=classify(e), crosses=attempt.crosses, groups=action.expected,
                        group=attempt.group.gathered)
        self.deadlines.observe(attempt.averaged.seconds, size=size)
        return dict(phase=Phase.CROSSED, gathered=attempt.averaged.gathered, crosses=attempt.crosses)

    def restore(self, attempt) -> None:
        """Keep a copy of our group's average in the buffers the first time, and put it back every other time."""
        with self.transport.buffers() as tensors:
            if attempt.group_average is None:
                attempt.group_average = [t.clone() for t in tensors]
            else:
                for tensor, saved in zip(tensors, attempt.group_average):
                    tensor.copy_(saved)

    def receive(self, action: Action, attempt) -> dict:
        """The swarm's average, from our group's delegate and the round's other delegates."""
        mine = self.announcer.record()
        try:
            attempt.averaged = self.transport.receive(action.delegate, mine.epoch, mine.state_hash, attempt.align,
                                                      timeout=max(attempt.deadline - self.clock.monotonic(), 0.1),
                                                      part_timeout=self.deadlines.part(1 + attempt.align))
        except Exception as e:
            attempt.detail = first_line(e)
            return dict(phase=Phase.RECEIVED, failure=classify(e))
        if self.announcer.identity.peer_id not in attempt.averaged.gathered:
            # our delegate's side of our group's all-reduce failed, and it crossed for a later group of its own: the
            # round's state does not hold our delta; it may have applied it elsewhere, so look, as for a lost one
            attempt.detail, attempt.averaged = f"{action.delegate[:8]}'s round did not merge our delta", None
            return dict(phase=Phase.RECEIVED, failure=Failure.DELEGATE_LOST)
        return dict(phase=Phase.RECEIVED, gathered=attempt.averaged.gathered)
