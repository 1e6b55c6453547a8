"""How a sync ended, and what it says: the ``Outcome`` that the metrics call ``outcome``, and ``describe``'s line of
text that they call ``error``.
"""

from __future__ import annotations

import enum
from typing import Optional


class Outcome(enum.Enum):
    """Why a sync ended as it did."""

    APPLIED = "applied"  # our group's (or our own, alone) outer step
    GROUP_FINISHED_WITHOUT_US = "group_finished_without_us"  # adopted our group's state, which merged our delta
    RESUMED_MERGED = "resumed_merged"  # the swarm had merged the work this restart resumed: not sent again
    CAUGHT_UP = "caught_up"  # adopted the swarm's state; contributing at its next sync
    MISSED_GROUP = "missed_group"  # missed the group, then caught up; contributing at the next sync
    MINORITY_ADOPTED = "minority_adopted"  # our group was a minority: adopted the majority's state
    MINORITY = "minority"  # our group was a minority: not applied, contributing next round
    DIVERGED = "diverged"  # our pseudo-gradient is not finite: this round's work is dropped
    RECORDS_LATE = "records_late"  # the swarm's records did not arrive in time
    PEERS_BEHIND = "peers_behind"  # the other live peers are behind us: they join us next round
    PEERS_AHEAD = "peers_ahead"  # a live peer holds a better state: catching up next round
    BELOW_QUORUM = "below_quorum"  # no group of --quorum peers formed
    NO_GROUP = "no_group"  # no group formed with the peers at our state; retrying next round
    LOST_MEMBER = "lost_member"  # the all-reduce lost a member; retried with the survivors while time allowed
    STATE_MISMATCH = "state_mismatch"  # a groupmate held a different state (round keys make this unreachable)
    AVERAGE_NOT_FINITE = "average_not_finite"  # the averaged pseudo-gradient is not finite
    NO_OTHER_GROUPS = "no_other_groups"  # our delegate met no other group's: contributing next round
    DELEGATE_LOST = "delegate_lost"  # our group's delegate brought no result: contributing next round
    LINK_LOST = "link_lost"  # a helper process of this node died (its p2p daemon, DHT or averager): the peer leaves


_TEXT = {
    Outcome.RESUMED_MERGED: "the swarm had merged the work this peer resumed from its checkpoint; not sent again",
    Outcome.CAUGHT_UP: "caught up with the swarm; contributing at its next sync",
    Outcome.GROUP_FINISHED_WITHOUT_US: "our group finished without us, with our delta merged: adopted its state",
    Outcome.MISSED_GROUP: "missed the group; caught up, contributing at the next sync",
    Outcome.MINORITY_ADOPTED: "{detail}: adopted the larger group's state, contributing at its next sync",
    Outcome.MINORITY: "{detail}: not applied; contributing next round",
    Outcome.DIVERGED: "local pseudo-gradient is not finite: dropped this round's work",
    Outcome.RECORDS_LATE: "could not read the swarm's records in time; contributing next round",
    Outcome.PEERS_BEHIND: "the {count} other live peer(s) are behind us; contributing next round",
    Outcome.PEERS_AHEAD: "{count} live peer(s) hold a better state; catching up next round",
    Outcome.BELOW_QUORUM: "no group of at least {count} peers formed",
    Outcome.NO_GROUP: "no group formed with the {count} peer(s) at our state; retrying next round",
    Outcome.LOST_MEMBER: "all-reduce failed ({detail}); retrying with the survivors",
    Outcome.STATE_MISMATCH: "a groupmate held a different state; not applied",
    Outcome.AVERAGE_NOT_FINITE: "the averaged pseudo-gradient is not finite; not applied",
    Outcome.NO_OTHER_GROUPS: "our group's delegate met no other group's; contributing next round",
    Outcome.DELEGATE_LOST: "our group's delegate brought no result ({detail}); contributing next round",
    Outcome.LINK_LOST: "{detail}",  # the line the peer leaves with (``dht.processes.part_died``)
}


def describe(outcome: Optional[Outcome], detail: str = "", count: int = 0) -> Optional[str]:
    """The outcome in a line (None for an applied round): ``detail`` is the failure's first line, ``count`` the
    action's."""
    if outcome is None or outcome is Outcome.APPLIED:
        return None
    return _TEXT[outcome].format(detail=detail, count=count)
