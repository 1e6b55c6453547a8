"""How a peer reads the swarm without a server: pure functions over the peers' DHT records.

- responsiveness: a peer whose record stopped its heartbeat, or that passed its planned sync long ago
  without a word, is not waited for;
- fork choice: the state with the most tokens merged wins, then the lowest hash (docs/design.md, step 7);
  every peer that reads the same records picks the same winner;
- the expected group: live peers that hold our exact state or are downloading it, so the matchmaking
  leader can close the group as soon as they have all joined instead of waiting out the grace window;
- the majority rule: when matchmaking splits the peers at one state into two groups, only a group
  holding more than half of them applies its round; the other adopts that state instead of forking it.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

from hivemind.utils import get_dht_time

from dht.records import PeerRecord
from peer.swarm.metadata import Gathered

SILENCE_SLACK = 10.0  # seconds past its planned sync a peer may stay silent before others stop waiting for it
MAX_MISSED = 3  # rounds in a row stuck at one state before a peer applies without a majority (alone, at quorum 1)
LEAVING = "leaving"  # a record status: the peer is about to leave and only serves its state meanwhile
SYNCING = "syncing"  # a record status: the peer is in a sync (matchmaking or all-reduce) until its busy_until
LATE_EPOCHS = 2  # a peer this many epochs behind, or fewer, is catching up by replay, not lost


def responsive(record: PeerRecord, now: float) -> bool:
    """False for a peer that is dead, frozen or cut off: when we last read its record it had missed
    HEARTBEAT_MISSES heartbeats (seconds after the peer stopped), or it passed its planned sync (or the deadline
    of the sync it is in) by more than one of its rounds (at least SILENCE_SLACK seconds) without publishing
    since. Its record lives on in the DHT until it expires, but nobody should wait for it, count it in a group,
    or download from it. (A copy we read long ago says nothing of the heartbeats since: only how stale the record
    was when read counts, never how old our copy is now.)"""
    if record.silent():
        return False
    if not record.next_sync_at:
        return True
    quiet_until = max(record.next_sync_at, record.busy_until or 0.0)  # a peer in a long sync says so
    return now < quiet_until + max(record.round_seconds or 0.0, SILENCE_SLACK)


def live(records: Iterable[PeerRecord], manifest_hash: str) -> List[PeerRecord]:
    """Peers of this run that have not left: their state counts in the fork choice, and they serve it."""
    return [r for r in records if r.manifest_hash == manifest_hash and r.status != "left"]


def active(records: Iterable[PeerRecord], manifest_hash: str) -> List[PeerRecord]:
    """Live peers that still train and average: not one that is ``LEAVING`` (it only serves its state)."""
    return [r for r in live(records, manifest_hash) if r.status != LEAVING]


def fork_key(record: PeerRecord):
    """Sort key, best first: most tokens merged, then the lowest hash as a deterministic tie-break."""
    return (-int(record.tokens_total), str(record.state_hash))


def choose_state(records: Iterable[PeerRecord], mine: PeerRecord) -> Optional[PeerRecord]:
    """The record of the state this peer should adopt, or None if its own state is the best."""
    candidates = live(records, mine.manifest_hash) + [mine]
    best = min(candidates, key=fork_key)
    return None if best.state_hash == mine.state_hash else best


def holds_state(record: PeerRecord, mine: PeerRecord) -> bool:
    return record.epoch == mine.epoch and record.state_hash == mine.state_hash


def peers_with_state(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None) -> List[PeerRecord]:
    """Other active, responsive peers at exactly our (epoch, state hash): the ones we can average with."""
    now = get_dht_time() if now is None else now
    return [r for r in active(records, mine.manifest_hash)
            if r.peer_id != mine.peer_id and holds_state(r, mine) and responsive(r, now)]


def joining(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None) -> List[PeerRecord]:
    """Other active, responsive peers downloading our exact state now: they join its next group if they can. A
    group that counted only the peers already holding the state closed before a late peer's download ended, round
    after round when the download took about as long as a round (the lag loop)."""
    now = get_dht_time() if now is None else now
    return [r for r in active(records, mine.manifest_hash)
            if r.peer_id != mine.peer_id and r.adopting == mine.state_hash and not holds_state(r, mine)
            and responsive(r, now)]


def syncing_now(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None,
                within: float = 0.0) -> List[PeerRecord]:
    """Peers at our exact state that are in a sync now (matchmaking or all-reduce), or plan to begin one ``within``
    seconds. A peer that has just adopted that state goes to matchmaking at once: its holders may be waiting for it
    (``joining``), and a round of its own would end after their group closed, the state it holds already being
    averaged onward."""
    now = get_dht_time() if now is None else now
    return [r for r in peers_with_state(records, mine, now)
            if (r.status == SYNCING and r.busy_until is not None and r.busy_until > now)
            or (within > 0 and r.status != SYNCING and r.next_sync_at is not None and r.next_sync_at <= now + within)]


def voters(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None,
           producers: Iterable[str] = ()) -> int:
    """The electorate of the majority rule, us included: responsive peers at our exact state, and the
    responsive peers whose deltas produced our state (``producers``: the group of its last outer step, from
    ``GlobalState.merged``), whatever epoch their record shows. A peer that has just caught up sees its
    producers' older records for a moment: counting exact matches only, it once took 2 of 5 for a majority (a
    fork, seen under load). Peers cut off by a partition are neither, so each half of a split swarm still
    trains on (the fork choice and carried-over work reunite them after the heal)."""
    now = get_dht_time() if now is None else now
    producers = set(producers)
    return 1 + sum(responsive(r, now) for r in active(records, mine.manifest_hash)
                   if r.peer_id != mine.peer_id and (holds_state(r, mine) or r.peer_id in producers))


def minority(gathered: Gathered) -> Optional[str]:
    """Why this group must not apply its round, or None if it may. Every member computes it from the same
    gathered data, so the whole group decides alike.

    Two groups formed from the peers at one state (a split matchmaking) would step that state two ways:
    a fork, which the fork choice then undoes by making the smaller group download the larger one's state.
    So a group applies only if it holds more than half of the largest electorate any member counted. Two
    minorities must not stall forever: with no majority possible outside the group either (a 2|2 split), it also
    applies once a member has sat MAX_MISSED - 1 rounds at this state without applying ("missed"; rounds lost
    catching up do not count: a peer that has just adopted the state is not stalled); with one possible, only after
    twice that (the others may be about to apply: a peer that lagged its group for two rounds once outvoted, with
    one other, the three peers still retrying that round, and forked it). Dead or frozen peers leave the electorate
    once they are no longer ``responsive``."""
    size = len(gathered)
    electorate = max(contribution.voters for contribution in gathered.values())
    missed = max(contribution.missed for contribution in gathered.values())
    stalled = (2 if majority_elsewhere(gathered) else 1) * MAX_MISSED
    if 2 * size > electorate or missed + 1 >= stalled:
        return None
    return f"our group holds {size} of the {electorate} peers at our state, not a majority"


def majority_elsewhere(gathered: Gathered) -> bool:
    """Could the peers outside this group hold a majority of the electorate (and so apply this round)?"""
    electorate = max(contribution.voters for contribution in gathered.values())
    return 2 * (electorate - len(gathered)) > electorate


def peers_behind(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None) -> List[PeerRecord]:
    """Other live, responsive peers at an earlier epoch than ours: they will catch up with the swarm's best
    state (a dead or frozen one will not)."""
    now = get_dht_time() if now is None else now
    return [r for r in active(records, mine.manifest_hash)
            if r.peer_id != mine.peer_id and r.epoch < mine.epoch and responsive(r, now)]


def producers_behind(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None,
                     producers: Iterable[str] = ()) -> List[PeerRecord]:
    """Other active, responsive peers whose deltas produced our state (``producers``) and whose record still shows an
    earlier epoch: they applied the same outer step as we did, so they hold our state, and their record says so as
    soon as it is republished and read. Expected in our group: counting only the records that show our state, a
    leader on a DHT a few seconds late closed its group at the 7 of 15 it saw, a minority, while the other 8 arrived
    (16 real peers, ``bench/results/scale.md``)."""
    now = get_dht_time() if now is None else now
    producers = set(producers)
    return [r for r in peers_behind(records, mine, now) if r.peer_id in producers]


def catching_up(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None,
                producers: Iterable[str] = ()) -> List[PeerRecord]:
    """Other active, responsive peers at most ``LATE_EPOCHS`` behind our state that did not produce it: they missed
    a group and replay the rounds since (``round/catchup.py``). With overlap they cannot meet the next group: its
    state is the result of an all-reduce that ends as that group meets, and they receive it only by replaying it
    after (``timing.next_round`` leaves them the time)."""
    now = get_dht_time() if now is None else now
    producers = set(producers)
    return [r for r in peers_behind(records, mine, now)
            if r.epoch >= mine.epoch - LATE_EPOCHS and r.peer_id not in producers]


def peers_ahead(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None) -> List[PeerRecord]:
    """Other active, responsive peers whose state wins the fork choice over ours. While one lives, a peer without a
    group never steps alone: its own step could only fork the run and lose; it catches up instead. (Stale records of
    peers cut off by a partition stop counting once they are no longer ``responsive``: a cut-off peer trains on.)"""
    now = get_dht_time() if now is None else now
    return [r for r in active(records, mine.manifest_hash)
            if r.peer_id != mine.peer_id and fork_key(r) < fork_key(mine) and responsive(r, now)]


def awaiting_state(records: Iterable[PeerRecord], mine: PeerRecord, now: Optional[float] = None) -> List[str]:
    """The peers a leaving peer (``mine``) should wait for: if no other active peer that can serve our state holds
    it, the active, responsive peers whose state loses the fork choice to ours. Without us they would never get it: a
    groupmate whose averaged parts our exit cut short, or a peer one round behind a group that all leaves at once.
    If another holder stays, it serves them, and nobody needs to wait."""
    now = get_dht_time() if now is None else now
    others = [r for r in active(records, mine.manifest_hash) if r.peer_id != mine.peer_id and responsive(r, now)]
    if any(holds_state(r, mine) and not r.client_mode for r in others):
        return []
    return [r.peer_id for r in others if fork_key(mine) < fork_key(r)]
