"""When rounds end, so that the peers holding one state reach matchmaking together: pure functions.

- After an outer step the group already agrees: every member computes the next round's length from the same
  gathered contributions (``next_round``: H steps at the median member's pace), and with overlap the end
  of the round already in progress (``round_end``: the median of the members' plans).
- With overlap a round's sync runs during the next round. A link that needs longer for a sync than a round lasts
  would make every sync end later than the last, the rounds after it shorter, until the swarm splits; so the
  group stretches its rounds (more inner steps) to outlast its syncs, up to ``MAX_STRETCH`` times. A peer that
  missed a group can meet the next only if it has replayed the last round's result by then, which that stretch
  leaves no time for: while one catches up, the rounds outlast the syncs by one more sync.
- A peer without that agreement (a joiner, one that caught up) lines up with the plans that the peers holding
  its state published in their records (``round_target``).
"""

from __future__ import annotations

import statistics
from typing import Iterable, Optional, Tuple

from dht.records import PeerRecord
from peer.swarm.consensus import peers_with_state
from peer.swarm.metadata import Gathered

CROSS_WINDOW = 2  # the cross-group phase's matchmaking window, in grace windows

SYNC_HEADROOM = 1.15  # a stretched round outlasts the members' median sync by this factor
# with a peer catching up, by one more sync: its replay of the round's result (one payload from several donors,
# where a member of 4 sends 1.5 in its all-reduce) fits in it, and it meets the group after
LATE_HEADROOM = SYNC_HEADROOM + 1.0
GRACE_SHARE = 0.25  # the matchmaking window is at least this share of a peer's recent syncs
MAX_STRETCH = 4.0  # at most this many times a round's planned length (beyond: the link is too thin for the run)


def matchmaking_window(now: float, meet_at: Optional[float], grace: float, cross: bool) -> float:
    """Seconds from ``now`` our matchmaking window lasts: until the meeting, then a grace window (two for the
    delegates of a round's groups, who meet as their groups finish: a left-over peer, its own delegate, learns it is
    left over only when its group window ends, and must still find the others waiting)."""
    return max(meet_at or now, now) - now + grace * (CROSS_WINDOW if cross else 1)


def next_round(gathered: Gathered, round_seconds: float, inner_steps: int) -> Tuple[Optional[float], float]:
    """The group's agreed length of its next inner phase, and its stretch (that length over the planned one). The
    planned length is ``round_seconds`` if the run fixes one, else H steps at the median member's pace; None if no
    member knows its pace yet. With overlap the members also tell how long their recent syncs took: a round lasts
    ``SYNC_HEADROOM`` times their median, if that is longer, so that the next sync finishes inside it; and
    ``LATE_HEADROOM`` times, if a member sees a peer catching up (``Contribution.late``), so that the peer also
    has time to replay the round's result before the group meets again."""
    paces = [c.step_seconds for c in gathered.values() if c.step_seconds is not None and c.step_seconds > 0]
    planned = round_seconds or (inner_steps * statistics.median(paces) if paces else None)
    syncs = [c.sync_seconds for c in gathered.values() if c.sync_seconds is not None and c.sync_seconds > 0]
    if planned is None or not syncs:
        return planned, 1.0
    headroom = LATE_HEADROOM if any(c.late for c in gathered.values()) else SYNC_HEADROOM
    seconds = min(MAX_STRETCH * planned, max(planned, headroom * statistics.median(syncs)))
    return seconds, seconds / planned


def matchmaking_grace(grace_seconds: float, sync_seconds: Optional[float], dht_lag: float = 0.0) -> float:
    """How long a group waits past its planned meeting for its members: ``--grace-seconds``, or a quarter of our
    recent syncs if longer, plus the DHT's lag (``RecordCache.lag``). The members of one all-reduce receive its
    last parts up to the time a reducer takes to send them all (on a 1 Mbit/s link, 10-15 s apart), and each counts
    its next round from then: a 5-s window missed the last of them. hivemind's matchmaking finds a group's leader
    through the DHT, so a DHT that delivers 8 s late hides every peer from a 5-s window: 16 peers on a machine loaded
    20-fold formed no group, or groups of 2-4, for minutes. A full group begins at once, so the longer window costs
    time only when a member is missing."""
    return (max(grace_seconds, GRACE_SHARE * sync_seconds) if sync_seconds else grace_seconds) + dht_lag


def round_end(gathered: Gathered) -> Optional[float]:
    """With overlap, the round after this sync's is already running on each member, planned to end when its own
    clock said. Every member takes the median of those plans, from the same gathered data: the group ends that
    round together, and its drift (each member's round had started from its own clock) is undone every round
    instead of adding up until a member misses its group."""
    plans = [c.planned_end for c in gathered.values() if c.planned_end is not None]
    return statistics.median(plans) if plans else None


def round_target(records: Iterable[PeerRecord], mine: PeerRecord, own_plan: Optional[float],
                 now: float, after: Optional[float] = None) -> Optional[float]:
    """When this round should end: the median of the planned sync times of every live peer holding our
    state, our own plan included. Peers that read the same records end their rounds together, the
    fast ones doing a few more steps and the slow ones a few fewer, so nobody waits at matchmaking.
    Only plans that end after ``after`` (default: now) count."""
    times = [r.next_sync_at for r in peers_with_state(records, mine, now)
             if r.next_sync_at and r.next_sync_at > max(now, after or now)]
    if own_plan is not None:
        times.append(own_plan)
    return statistics.median(times) if times else None
