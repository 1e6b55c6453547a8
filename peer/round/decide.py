"""The round's decisions, as one pure function: ``decide(view) -> Action``.

A sync (``peer/round/sync.py``) is a loop: build a ``View`` of what this peer knows now, ask ``decide`` what to do,
do it, and look again. Every choice the protocol makes lives here, over typed facts: the swarm's records, our
own record, the counters of this sync, and what the last action found out. Nothing here waits, reads the network
or touches a tensor, so every branch is tested in milliseconds (``tests/test_decide.py``), and the same code can
drive a simulated swarm.

The phases of a sync, and what each decides:

- ``BEGIN``, after the sync's first catch-up. A restart whose resumed work the swarm had merged already stops
  (it would count that work twice). A peer that just adopted the swarm's state joins its holders if they are
  syncing now (they may be waiting for it); else it keeps training on their state and contributes at their
  next sync.
- ``READY``, buffers filled and records read, before an attempt: whom to average with. Nobody else at our state:
  a lone peer steps alone, unless the records are late or the others are behind (they will join us next round),
  or a live peer holds a better state, or the quorum is above 1. Else: average with the expected group.
- ``FAILED``, an attempt raised: by the failure's type (``Failure``), never its text.
  A minority group, or a member's reducer that finished before the attempt failed for us (``MAYBE_APPLIED``),
  first looks for its group's finished state (``SETTLE``); a lost member retries with the survivors; no group at
  all first catches up.
- ``SETTLED``: a minority that adopted the majority's state is rebased; a maybe-applied attempt whose group did
  merge our delta is applied; else a retry.
- ``CROSSED``, as our group's delegate: apply the round's average; after a lost member, cross again; if no other
  group came, a majority group applies on its own, and a group whose round ended without it (the swarm moved on
  while it was late) catches up.
- ``CAUGHT_UP``, after a missed group (or a late group's cross): rebased if we adopted a state; after a cross,
  nothing more; retry at once if the holders of our state just began syncing; after MAX_MISSED rounds stuck with
  nobody else voting at our state (and none met there), step alone; else wait for the next round.
- ``AVERAGED``: apply the group's average, if every member held our state.

Finishing outcomes are ``Outcome``s (``outcomes.py``): the metrics' ``outcome``, and ``describe`` gives the line of
text that the metrics call ``error``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

from dht.records import PeerRecord
from peer.round.outcomes import Outcome
from peer.swarm.consensus import (
    MAX_MISSED,
    holds_state,
    joining,
    minority,
    peers_ahead,
    peers_behind,
    peers_with_state,
    producers_behind,
    responsive,
    syncing_now,
    voters,
)
from peer.swarm.failures import DelegateLost, MaybeApplied, MinorityGroup, NoGroup, NoMajority
from peer.swarm.grouping import delegate, plan
from peer.swarm.metadata import Gathered


class Phase(enum.Enum):
    BEGIN = "begin"
    READY = "ready"
    FAILED = "failed"
    SETTLED = "settled"
    CAUGHT_UP = "caught_up"
    AVERAGED = "averaged"
    CROSSED = "crossed"
    RECEIVED = "received"


class Failure(enum.Enum):
    """How an averaging attempt failed, from the exception's type (``peer/swarm/failures.py``)."""

    NO_GROUP = "no_group"  # matchmaking formed no group
    MINORITY = "minority"  # the group is a minority of the peers at our state; a majority elsewhere may apply
    NO_MAJORITY = "no_majority"  # a minority, with no majority possible elsewhere either (a 2|2 split)
    LOST_MEMBER = "lost_member"  # the all-reduce lost a member: nothing from it was applied
    MAYBE_APPLIED = "maybe_applied"  # it failed for us after our reducer finished: the others may have applied
    DELEGATE_LOST = "delegate_lost"  # our group's delegate brought no result: it may have applied with our delta


class Do(enum.Enum):
    FINISH = "finish"  # stop: the sync's outcome is ``Action.outcome`` (or the last one recorded)
    LOOK_AT_HOLDERS = "look_at_holders"  # read the records afresh: are the holders of our state syncing now?
    ATTEMPT = "attempt"  # fill the buffers (and read the records, ``refresh``), then decide at READY
    AVERAGE = "average"  # matchmaking with the expected group, then the exact all-reduce
    SETTLE = "settle"  # look for our group's finished state, and adopt it if it appears
    CATCH_UP = "catch_up"  # adopt the swarm's best state if it beats ours
    STEP_ALONE = "step_alone"  # our own pseudo-gradient is the outer step
    APPLY = "apply"  # the group's averaged pseudo-gradient is the outer step
    CROSS = "cross"  # as our group's delegate, the cross-group all-reduce of the groups' averages
    RECEIVE = "receive"  # take the swarm's average from our group's delegate (and the round's others)


@dataclass(frozen=True)
class Action:
    do: Do
    outcome: Optional[Outcome] = None  # recorded now: why the sync ends (FINISH), or what the last attempt met
    count: int = 0  # the peers an outcome speaks of (behind, ahead, expected)
    refresh: bool = False  # ATTEMPT: read the swarm's records before it
    send_carried: bool = False  # ATTEMPT: deltas carried from a fork just left go out now, with their tokens
    expected: int = 0  # AVERAGE: the peers we expect at our state, us included; CROSS: the groups we expect
    target: int = 0  # AVERAGE: the size our group closes at: its expected members (``grouping.plan``)
    groups: int = 1  # AVERAGE: the groups the round is expected to have (1: one group of all)
    group: int = -1  # AVERAGE: which group we meet in (-1: one group of all)
    probe: Tuple[str, ...] = ()  # AVERAGE: the expected peers to dial while the group forms
    members: Tuple[str, ...] = ()  # AVERAGE: our group's other expected members (any reach), whose places it keeps
    voters: int = 1  # AVERAGE: the electorate we count, us included
    min_group: int = 0  # AVERAGE: the fewest members a group may close with at its window's end (0: the quorum's)
    delegate: str = ""  # RECEIVE: our group's delegate
    own_group: bool = False  # APPLY: our group's average, as a majority whose delegate met no other group's


def classify(error: BaseException) -> Failure:
    """How an attempt failed, by the exception's type; anything unforeseen counts as a lost member (retried)."""
    if isinstance(error, NoMajority):
        return Failure.NO_MAJORITY
    if isinstance(error, MinorityGroup):
        return Failure.MINORITY
    if isinstance(error, NoGroup):
        return Failure.NO_GROUP
    if isinstance(error, MaybeApplied):
        return Failure.MAYBE_APPLIED
    if isinstance(error, DelegateLost):
        return Failure.DELEGATE_LOST
    return Failure.LOST_MEMBER



@dataclass(frozen=True)
class View:
    """What this peer knows when it decides."""

    phase: Phase
    mine: PeerRecord  # our own record: our state now
    records: Tuple[PeerRecord, ...]  # the other peers' records, as last read
    now: float  # DHT time the records are judged at: now, or while reads time out, the last read that answered
    quorum: int
    retries: int  # how many times a sync may retry
    group_size: int = 0  # the largest group (0: one group of all the peers at a state)
    attempts: int = 0  # attempts made in this sync
    time_left: float = 1.0  # seconds to the sync's deadline
    # rounds in a row this peer sat at its state without applying and without meeting another peer at it, before
    # this one: what the escapes to step alone count. A round that met others at our state (a minority group) says
    # they live, and a view emptied since by reads that time out says nothing of them (``Synchronizer.lonely``)
    lonely: int = 0
    stuck: int = 0  # rounds in a row this peer sat at its state without applying, before this one
    producers: Tuple[str, ...] = ()  # the peers whose deltas our state's last outer step merged
    lookup_failed: bool = False  # the last read of the records timed out: what we know may be stale
    records_fresh: bool = False  # the records were read since the last attempt
    dropped_resumed: bool = False  # BEGIN: an adoption found the work we resumed merged already
    caught_up: Optional[bool] = None  # BEGIN, CAUGHT_UP: the catch-up adopted a state
    holders_syncing: Optional[bool] = None  # BEGIN, CAUGHT_UP: answered by LOOK_AT_HOLDERS
    finite: bool = True  # READY: our pseudo-gradient is finite
    failure: Optional[Failure] = None  # FAILED, SETTLED, CAUGHT_UP: how the attempt failed
    expected: int = 0  # FAILED, SETTLED, CAUGHT_UP: the group the attempt expected
    settled: bool = False  # SETTLED: we adopted our group's finished state
    merged_ours: bool = False  # SETTLED: that state merged our delta
    gathered: Optional[Gathered] = None  # AVERAGED: the group's contributions; CROSSED, RECEIVED: the round's
    groups: int = 1  # AVERAGED: the groups the round was expected to have
    crosses: int = 0  # CROSSED: cross-group attempts made in this sync
    group: Optional[Gathered] = None  # CROSSED: our own group's contributions


def decide(view: View) -> Action:
    return _BY_PHASE[view.phase](view)


def _begin(view: View) -> Action:
    if view.dropped_resumed:
        return Action(Do.FINISH, Outcome.RESUMED_MERGED)
    if view.caught_up:
        if view.holders_syncing is None:
            return Action(Do.LOOK_AT_HOLDERS)
        if not view.holders_syncing:
            # the holders of the state we just adopted are training towards their next sync: train on their state
            # and contribute then. If they are syncing now, they may be waiting for us (our record said we were
            # downloading their state): join them
            return Action(Do.FINISH, Outcome.CAUGHT_UP)
    return _next(view, send_carried=bool(view.caught_up))


def _next(view: View, outcome: Optional[Outcome] = None, send_carried: bool = False) -> Action:
    """Another attempt, while the sync has attempts and time left; else finish with what the last one met."""
    if view.attempts > view.retries or view.time_left <= 0:
        return Action(Do.FINISH, outcome)
    return Action(Do.ATTEMPT, outcome, refresh=view.attempts > 0 and not view.records_fresh,
                  send_carried=send_carried)


def _ready(view: View) -> Action:
    if not view.finite:
        return Action(Do.FINISH, Outcome.DIVERGED)
    joiners = joining(view.records, view.mine, view.now)
    # the peers at our state: those whose records say so, and those of its producers whose records are still late
    late = [r for r in producers_behind(view.records, view.mine, view.now, view.producers) if r not in joiners]
    holders = peers_with_state(view.records, view.mine, view.now) + late
    expected = 1 + len(holders) + len(joiners)
    if expected > 1:
        group, size, mates, groups = plan([r.peer_id for r in holders + joiners], view.mine.peer_id,
                                          view.mine.epoch, view.group_size, producers=len(view.producers))
        electorate = voters(view.records, view.mine, view.now, producers=view.producers)
        if size == 1:
            # nobody else meets in our group this round: we are its delegate at once. Our group of one counts the
            # same electorate as any group: counting only itself, a lone delegate whose cross met nobody took its
            # group for a majority and stepped alone (a fork, seen under load)
            return Action(Do.CROSS, expected=groups, voters=electorate)
        # a holder killed just now still has a fresh record: the averager asks the network whether it is gone
        probe = tuple(r.peer_id for r in holders if not r.client_mode and r.peer_id in mates)
        # one group of all closes at its window's end only as a majority: a minority could not apply (the majority
        # rule), and its members, sent away instead, can still join the majority's group in time. A group of a round
        # of many, only with most of its expected members: the leader of ours may have closed it at the count it
        # expected, and two late members then formed a group of their own, whose delegate took another group's place
        # in the cross-group round, which closes at the count of groups (bench/scale.py's 64 peers in groups of 32:
        # the 30 of one group index a minority, the 31 of the other alone). Unless we are stalled: then a minority
        # may apply (consensus.minority), so it must be able to form
        majority = (electorate if groups == 1 else size) // 2 + 1 if view.stuck + 1 < MAX_MISSED else 0
        return Action(Do.AVERAGE, expected=expected, target=size, groups=groups, group=group if groups > 1 else -1,
                      probe=probe, members=tuple(mates), voters=electorate, min_group=min(size, majority))
    stalled = view.lonely + 1 >= MAX_MISSED
    if view.lookup_failed and not stalled:
        # stepping alone on a view that may be empty only because it is late would fork the run
        return Action(Do.FINISH, Outcome.RECORDS_LATE)
    behind = peers_behind(view.records, view.mine, view.now)
    if behind and not stalled:
        # they adopt our state at their next round (or their records are stale, as in a partition): stepping alone
        # now would fork the run; contribute with them next round
        return Action(Do.FINISH, Outcome.PEERS_BEHIND, count=len(behind))
    return _alone(view)


def _alone(view: View) -> Action:
    """No group: a quorum-1 peer's own delta is its outer step; with a larger quorum, wait. Never while a live peer
    holds a better state: our download of it failed (in a rehearsal all its holders moved on during it), and a step
    of our own would fork the run and lose the fork choice; we catch up next round instead."""
    ahead = peers_ahead(view.records, view.mine, view.now)
    if ahead:
        return Action(Do.FINISH, Outcome.PEERS_AHEAD, count=len(ahead))
    if view.quorum > 1:
        return Action(Do.FINISH, Outcome.BELOW_QUORUM, count=view.quorum)
    return Action(Do.STEP_ALONE)


def _failed(view: View) -> Action:
    failure = view.failure
    if failure is Failure.MINORITY:  # the larger group applies this round: adopt its state when it does
        return Action(Do.SETTLE)
    if failure is Failure.NO_MAJORITY:  # nobody applies this round: there is no state to wait for
        return Action(Do.FINISH, Outcome.MINORITY)
    if failure is Failure.MAYBE_APPLIED:
        # others may still be receiving their last parts: look for their new state for as long as their all-reduce
        # may take, before averaging our delta again into a different state
        return Action(Do.SETTLE, Outcome.LOST_MEMBER)
    if failure is Failure.LOST_MEMBER:
        return _next(view, Outcome.LOST_MEMBER)
    return Action(Do.CATCH_UP)  # no group: did the swarm move on without us?


def _settled(view: View) -> Action:
    if view.failure is Failure.MINORITY:
        return Action(Do.FINISH, Outcome.MINORITY_ADOPTED if view.settled else Outcome.MINORITY)
    if view.settled and view.merged_ours:
        return Action(Do.FINISH, Outcome.GROUP_FINISHED_WITHOUT_US)
    if view.failure is Failure.DELEGATE_LOST or view.crosses:  # a new attempt would miss our group's round
        return Action(Do.FINISH, Outcome.DELEGATE_LOST if view.failure is Failure.DELEGATE_LOST
                      else Outcome.LOST_MEMBER)
    return _next(view)  # the attempt's LOST_MEMBER stands


def _caught_up(view: View) -> Action:
    """After a missed group (``Failure.NO_GROUP``) and the catch-up that followed it."""
    if view.caught_up:
        return Action(Do.FINISH, Outcome.MISSED_GROUP)
    if view.crosses:  # our group's round is over: a new attempt would meet nobody
        return Action(Do.FINISH, Outcome.NO_OTHER_GROUPS)
    if view.attempts <= view.retries:
        if view.holders_syncing is None:
            return Action(Do.LOOK_AT_HOLDERS)
        if view.holders_syncing:
            # the peers at our state began their sync after our matchmaking gave up on them (we had just adopted it
            # and read a holder's record from its own catch-up a moment ago): they count on us now
            # (``consensus.peers_with_state``); a round of ours first would miss their group
            return _next(view)
    if view.lonely + 1 >= MAX_MISSED and voters(view.records, view.mine, view.now) == 1:
        return _alone(view)  # the others at our state went silent: we are alone
    # stepping alone while others at our state are alive would fork the run (a minority of 1)
    return Action(Do.FINISH, Outcome.NO_GROUP, count=view.expected - 1)


def _averaged(view: View) -> Action:
    """Our group's all-reduce is done. One group of all applies it (the averager gated it by the majority rule); a
    group of a round of many goes on to the cross-group phase: its delegate averages with the other groups'
    delegates, and the others take the result from it."""
    if _mismatch(view):
        return Action(Do.FINISH, Outcome.STATE_MISMATCH)  # round keys make this unreachable
    if all(contribution.groups == 1 for contribution in view.gathered.values()):
        return Action(Do.APPLY)
    speaker = delegate(view.gathered, view.mine.epoch)
    if speaker == view.mine.peer_id:
        return Action(Do.CROSS, expected=view.groups)
    return Action(Do.RECEIVE, delegate=speaker)


def _crossed(view: View) -> Action:
    """After the cross-group all-reduce, as our group's delegate."""
    if view.gathered is not None:
        return Action(Do.FINISH, Outcome.STATE_MISMATCH) if _mismatch(view) else Action(Do.APPLY)
    if view.failure is Failure.NO_GROUP:  # no other group's delegate came: a majority group applies on its own
        if peers_ahead(view.records, view.mine, view.now):
            return Action(Do.CATCH_UP)  # unless the round ended without our group (it was late): the swarm moved on
        if view.group is not None and minority(view.group) is None:
            return Action(Do.APPLY, own_group=True)
        return Action(Do.FINISH, Outcome.NO_OTHER_GROUPS)
    if view.failure is Failure.LOST_MEMBER:  # from our group's average again, while attempts and time remain
        if view.crosses <= view.retries and view.time_left > 0:
            return Action(Do.CROSS, Outcome.LOST_MEMBER, expected=view.groups)
        return Action(Do.FINISH, Outcome.LOST_MEMBER)
    return _failed(view)  # a minority, no majority, or maybe applied: as after a group's attempt


def _received(view: View) -> Action:
    """After asking our group's delegate for the swarm's average."""
    if view.gathered is not None:
        return Action(Do.FINISH, Outcome.STATE_MISMATCH) if _mismatch(view) else Action(Do.APPLY)
    if view.failure is Failure.DELEGATE_LOST:  # it may have applied with our delta: look for that state
        return Action(Do.SETTLE)
    return _failed(view)  # its cross-group round was a minority, or no majority


def _mismatch(view: View) -> bool:
    mine = (view.mine.epoch, view.mine.state_hash)
    return any((c.epoch, c.hash) != mine for c in view.gathered.values())


_BY_PHASE = {Phase.BEGIN: _begin, Phase.READY: _ready, Phase.FAILED: _failed, Phase.SETTLED: _settled,
             Phase.CAUGHT_UP: _caught_up, Phase.AVERAGED: _averaged, Phase.CROSSED: _crossed,
             Phase.RECEIVED: _received}


def holders_syncing(view: View) -> bool:
    """Are peers at our exact state in a sync now (``consensus.syncing_now``)?"""
    return bool(syncing_now(view.records, view.mine, view.now))


def settle_longer(extended: bool, unreachable: bool, attempts: int, retries: int, time_left: float) -> bool:
    """A settle saw its group's new state, but none of its holders answered (a reducer that finished the round,
    then lost its link): spend our next attempt's time trying again, once, if the sync has an attempt and time
    left. Averaging again without it forks the run until fork choice joins the two states."""
    return not extended and unreachable and attempts <= retries and time_left > 0


def why_alone(view: View, dht_lag: float) -> str:
    """A lone step may fork the run: the log says what the peer saw (``dht_lag``: how late the DHT delivers)."""
    at_ours = [r for r in view.records if holds_state(r, view.mine)]
    silent = sum(not responsive(r, view.now) for r in at_ours)
    return (f"stepping alone at epoch {view.mine.epoch} after {view.phase.value}, {view.lonely} round(s) without "
            f"applying or meeting a peer at our state: {len(view.records)} other record(s) known, "
            f"{len(at_ours)} at our state ({silent} silent)"
            + ("; our last read of the records timed out" if view.lookup_failed else "")
            + (f"; the DHT delivers records {dht_lag:.0f} s late" if dht_lag else ""))
