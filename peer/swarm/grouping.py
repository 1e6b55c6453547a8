"""Rounds for a swarm larger than one group: how many groups, who speaks for each, and what they add up to.

A swarm of fewer than 2.5 times ``--group-size`` peers at one state meets in one group, as a small swarm always has.
A larger one meets in about ``N / group_size`` groups, at least ``MIN_GROUPS`` (``plan``; N: the peers whose deltas
made the state): every peer computes, from the records it read, which group each expected peer meets in, and meets
its own under a matchmaking key of that group's, expecting its members, so a group closes as soon as they have all
joined. Each group then runs three phases (docs/design.md, "Rounds of many groups"):

1. an exact all-reduce inside the group: every member holds the group's average, bit-identical;
2. the group's delegate (``delegate``) meets the other groups' delegates in one cross-group exact all-reduce of the
   groups' averages, weighted by each group's total weight: every delegate holds the swarm's average;
3. every other member downloads that average from the delegates, the very bytes they decoded.

Every peer that applies the round then decodes the same bytes and takes the same outer step: one state hash.
A group that is a majority of the peers at its state applies after phase 1, as one group always has.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Mapping, Tuple, Union

from peer.swarm.consensus import majority_elsewhere, minority
from peer.swarm.failures import GroupLostMember, MinorityGroup, NoMajority
from peer.swarm.metadata import Contribution, Delegation, Gathered

MIN_GROUPS = 3  # a round of many groups has at least this many; fewer meet in one group of all


def group_count(expected: int, group_size: int) -> int:
    """How many groups ``expected`` peers at one state meet in: ``expected / group_size``, rounded, so about
    ``group_size`` peers each (0: one group of all). Rounded, not truncated: the count, and with it every group,
    changes only when the swarm grows or shrinks by half a group, not whenever one peer dies or returns around a
    multiple of the group size.

    One group of all where that makes fewer than ``MIN_GROUPS``, that is below 2.5 times ``group_size``; never two.
    A round applies only as a majority of the peers at its state, and neither of two groups is one alone: one
    delegate lost in the cross-group phase, or one group late to it, cost the whole swarm its round, where one group
    of all retries with its survivors (``bench/scale.py``, 16 peers in 2 groups of 8, 4 of them at 6-s steps: a
    round that 14-15 peers failed in 3 of 5 seeds; one group of 16: at most 3 in any round). Of three or more, the
    others still make a majority without any one."""
    count = int(expected / group_size + 0.5) if group_size else 1
    return count if count >= MIN_GROUPS else 1


def group_of(peer_id: str, epoch: int, count: int) -> int:
    """Which of ``count`` groups a peer meets in this epoch: a hash of its id and the epoch, so that every peer that
    reads the same records puts every peer in the same group, a peer two others disagree about (a dead one, a
    joiner) changes only its own group, and the groups mix from one epoch to the next."""
    digest = hashlib.sha256(f"group:{epoch}:{peer_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


def plan(expected: Iterable[str], me: str, epoch: int, group_size: int, producers: int = 0
         ) -> Tuple[int, int, List[str], int]:
    """(our group, its expected size, its other expected members, the groups the round has) for the peers expected
    at our state, us included. With one group: (0, all of them, the others, 1).

    The count of groups follows ``producers``, the peers whose deltas made our state (``GlobalState.merged``), which
    every peer at the state holds alike; only without them (the first round) does it follow the peers we expect. Two
    views one peer apart around a boundary of the rounding would otherwise count different groups and put everyone
    in a different group: at 60 peers in groups of 8, they split the cross-group round 41 | 19 (``bench/scale.py``).
    """
    peers = sorted(set(expected) | {me})
    count = group_count(producers or len(peers), group_size)
    if count == 1:
        return 0, len(peers), [p for p in peers if p != me], 1
    groups = [group_of(peer, epoch, count) for peer in peers]
    ours = group_of(me, epoch, count)
    mates = [peer for peer, group in zip(peers, groups) if group == ours and peer != me]
    return ours, 1 + len(mates), mates, len(set(groups))


def delegate(gathered: Gathered, epoch: int) -> str:
    """The member that speaks for its group in the cross-group phase: among those that accept connections (they
    serve the result to the others), the one whose id hashes lowest with the epoch, so the duty moves from round to
    round. Every member computes the same one from the same gathered data. A group of clients elects a client, which
    serves nobody: its groupmates find the new state by catching up."""
    servers = [peer for peer, contribution in gathered.items() if not contribution.client] or list(gathered)
    return min(servers, key=lambda peer: hashlib.sha256(f"{epoch}:{peer}".encode()).hexdigest())


def union(delegations: Iterable[Delegation]) -> Gathered:
    """Every contribution the cross-group phase merges: the groups' members, each once. A peer in two groups' averages
    (its side of one failed after the others finished it, and it met a later group of its own) counts once here, and
    twice in the average, for one round: failing the cross-group round for it cost the whole swarm its round (all
    256 peers, in ``bench/scale.py``)."""
    merged: Dict[str, object] = {}
    for delegation in delegations:
        for peer, contribution in delegation.members.items():
            merged.setdefault(peer, contribution)
    return merged


def admit(words: Mapping[str, Union[Contribution, Delegation]], cross: bool) -> Gathered:
    """What a formed group checks before anyone sends, from the words every member gathered alike (so all send or
    none does): the members agree on sending first moments, and the majority rule (``consensus.minority``) holds
    over every contribution the all-reduce would merge. In a round of many groups a group is a minority by design:
    there the cross-group phase, over the delegates' merged groups, is the one that gates. Returns those
    contributions; raises ``GroupLostMember``, ``MinorityGroup`` or ``NoMajority``."""
    if cross:
        if any(peer not in delegation.members for peer, delegation in words.items()):
            raise GroupLostMember("a delegate is not a member of its own group")
        gathered = union(words.values())
    else:
        gathered = dict(words)
    if len({word.align for word in words.values()}) != 1:
        raise GroupLostMember("group members disagree on momentum alignment")
    if cross or all(contribution.groups == 1 for contribution in gathered.values()):
        why_not = minority(gathered)
        if why_not is not None:
            raise (MinorityGroup if majority_elsewhere(gathered) else NoMajority)(why_not)
    return gathered

