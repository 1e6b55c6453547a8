"""How a round's averaging can fail, one exception type per outcome the round decides on (``peer/round/decide.py``).

All are hivemind ``AllreduceException``s, so hivemind's averager hands them to the caller's step control, from
the averager process to the peer's, instead of retrying them itself.
"""

from __future__ import annotations

from hivemind.averaging.partition import AllreduceException


class NoGroup(AllreduceException):
    """Matchmaking ended without a group: nobody else at our state joined us within the window."""


class GroupLostMember(AllreduceException):
    """The all-reduce lost a member (or got bad data) mid-way; nothing from it may be applied."""


class MaybeApplied(GroupLostMember):
    """It failed for us after our own reducer had averaged all its parts: the others may have received every
    part and applied the round. (When our reducer failed, no member can hold the whole average.)"""


class MinorityGroup(AllreduceException):
    """The group holds too few of the peers at its state to apply a round (``peer.swarm.consensus.minority``);
    nothing was sent. The peers outside it are a majority: they may apply this round."""


class NoMajority(MinorityGroup):
    """As MinorityGroup, but the peers outside the group are no majority either (a 2|2 split): no group
    applies this round, so there is no new state to wait for."""


class DelegateLost(AllreduceException):
    """Our group's delegate brought no result of the cross-group phase (it failed, stalled, or gave up): it may
    have applied the round, with our delta, before it stopped answering."""
