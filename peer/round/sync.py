"""The sync phase of a round, behind one call: catch up, average, apply the outer step.

``Synchronizer.sync(tokens, budget)`` runs the loop of ``decide.py``: build a view, decide, act, look again. The
actions, each done here or in ``catchup.py``:
1. catch up: if the swarm holds a better state (fork choice), download it, check its hash, and rebase onto it,
   keeping this peer's unmerged work (theta <- G_new - delta);
2. attempt: write delta = G - theta (and, every k rounds, AdamW's first moment) into the averager's buffers;
3. average: matchmaking among the live peers that hold the same (epoch, hash), for at most the grace window,
   then the exact all-reduce, weighted by tokens; a lost member fails the attempt, and it is retried with the
   survivors from G and theta, which the attempt never touched;
4. apply: Nesterov on the averaged delta, identical on every member: e <- e+1, theta <- G.
With ``--fragments F`` every step above concerns the fragment of the flat vector that round ``e`` averages
(``peer/outer/fragments.py``): the delta sent and the outer step are that fragment's, the rest of theta trains on.
If no group forms, a peer alone (quorum 1) applies its own delta: a lone peer never blocks. With a larger quorum
it applies nothing, keeps training, and its delta keeps growing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from diloco_compression.feedback import ErrorFeedback

from dht.errors import first_line
from dht.processes import LinkLost
from peer.averaging.pacing import socket_queue_hint
from peer.config import RunConfig, SyncConfig
from peer.hooks import MATCHMAKING, Hooks
from peer.outer.lineage import Lineage
from peer.outer.state import GlobalState
from peer.round.announce import Announcer
from peer.round.catchup import StateCatchUp
from peer.round.cross import Crossing
from peer.round.decide import Action, Do, Phase, View, classify, decide, why_alone
from peer.round.meeting import Meeting
from peer.round.outcomes import Outcome, describe
from peer.round.outer import OuterStep
from peer.swarm.clock import Clock
from peer.swarm.consensus import SYNCING, catching_up, peers_ahead, responsive
from peer.swarm.deadlines import Deadlines
from peer.swarm.metadata import Averaged, Contribution
from peer.swarm.records import RecordCache
from peer.swarm.timing import matchmaking_window, next_round, round_end
from peer.train.flat import FlatLayout
from peer.train.local import LocalModel

logger = logging.getLogger(__name__)

REBASED = (Outcome.CAUGHT_UP, Outcome.MISSED_GROUP, Outcome.MINORITY_ADOPTED, Outcome.GROUP_FINISHED_WITHOUT_US)
MET_OTHERS = (Outcome.MINORITY, Outcome.DELEGATE_LOST)  # not applied, but a group of peers at our state formed


@dataclass
class SyncResult:
    applied: bool = False
    group: Tuple[str, ...] = ()
    group_tokens: int = 0
    attempts: int = 0
    aligned: bool = False
    rebased: bool = False
    outcome: Optional[Outcome] = None  # why the sync ended as it did (``outcomes.Outcome``)
    error: Optional[str] = None  # the outcome in a line (``outcomes.describe``); None when applied
    next_round_seconds: Optional[float] = None  # the group's agreed length of the next inner phase
    stretch: float = 1.0  # that length over the planned one: above 1 when syncs outlast rounds (overlap)
    averaging_seconds: Optional[float] = None  # the group's attempt that applied, from its start: what overlap times
    allreduce_seconds: Optional[float] = None  # of that attempt, from its group formed: the rest was matchmaking
    round_end: Optional[float] = None  # overlap: the group's agreed end (DHT time) of the round in progress
    offences: Dict[str, List[str]] = dataclasses.field(default_factory=dict)  # peer -> its bad parts we reduced
    reduced: float = 0.0  # the fraction of the group's vector we reduced in the all-reduce that applied
    groups: int = 0  # the groups whose work the applied round merged (1: one group; 0: none applied)
    waited: float = 0.0  # seconds spent waiting for the planned meeting time (``meet_at``) or a late one's groupmates
    catch_up_seconds: float = 0.0  # seconds the opening catch-up took (a download when the swarm moved on)
    deadline: float = 0.0  # the longest this sync could run: its budget plus ``waited``


@dataclass
class _Attempt:
    """One sync's running facts: what the view does not hold."""

    tokens: int
    missed_rounds: int  # rounds in a row our work went unmerged: it weighs tokens x stale_discount^missed_rounds
    deadline: float  # monotonic
    planned_end: Callable[[], Optional[float]]
    meet_at: Optional[float] = None  # DHT time our group planned to meet: the first attempt's windows run from it
    meets: float = 0.0  # the same, in monotonic time
    overlapped: bool = False  # the sync runs while the next round trains: we tell the group our syncs' length
    recovered: int = 0  # carried tokens this sync took from the lineage
    align: bool = False
    started: float = 0.0
    detail: str = ""  # the last failure's first line
    averaged: Optional[Averaged] = None  # what the last all-reduce (or the delegates) brought: what APPLY applies
    group: Optional[Averaged] = None  # a round of many groups: our group's all-reduce, which our delegation carries
    group_average: Optional[List[torch.Tensor]] = None  # a delegate's copy of it, for a cross-group retry
    crossed: Optional[Tuple[int, str]] = None  # as a delegate: the round (epoch, hash) our groupmates wait for
    tries: int = 0  # group attempts made
    crosses: int = 0


class Synchronizer:
    def __init__(self, *, transport, clock: Clock, cache: RecordCache, announcer: Announcer, catchup: StateCatchUp,
                 state: GlobalState, local: LocalModel, layout: FlatLayout, lineage: Lineage,
                 feedback: ErrorFeedback, lock: threading.Lock, deadlines: Deadlines, run: RunConfig,
                 sync: SyncConfig, has_moment: bool, hooks: Hooks, initial_peer_ids: Sequence[str] = ()):
        self.transport, self.clock, self.cache, self.announcer = transport, clock, cache, announcer
        self.catchup = catchup
        self.state, self.lineage = state, lineage
        self.lock, self.deadlines, self.run, self.config = lock, deadlines, run, sync
        self.has_moment, self.hooks, self.initial_peer_ids = has_moment, hooks, tuple(initial_peer_ids)
        self.step_seconds: Optional[float] = None
        self.hinted = False  # told the user how to keep a thin uplink's socket queues short
        self.meeting = Meeting(clock, catchup, cache, announcer.identity.peer_id, run.grace_seconds)
        # rounds in a row we sat at this epoch without applying: what the escapes from waiting count (not the
        # unmerged rounds, which include rounds lost catching up; a peer that just adopted the swarm's state is
        # not stalled, and once counted as such it forked a majority still at work)
        self.stuck, self.stuck_epoch = 0, -1
        self.lonely = 0  # of those, the rounds in a row that met no other peer at our state (``View.lonely``)
        self.crossing = Crossing(transport, clock, announcer, deadlines, run, moved_on=self._moved_on)
        self.outer = OuterStep(state, local, layout, lineage, feedback, lock, run, buffers=transport.buffers,
                               outgoing=hooks.outgoing)

    # ---- one round ----
    def sync(self, tokens: int, budget: float, missed_rounds: int = 0, step_seconds: Optional[float] = None,
             planned_end: Callable[[], Optional[float]] = lambda: None, meet_at: Optional[float] = None,
             overlapped: bool = False) -> SyncResult:
        """Average this round's work with the peers that hold our state; see the module docstring.

        ``missed_rounds``: rounds in a row this peer's work went unmerged; it weighs
        tokens x stale_discount^missed_rounds in the average (docs/design.md, step 6).
        ``step_seconds``: this peer's recent seconds per inner step, shared with the group so that every
        member computes the same length for the next round (H steps of the median member).
        ``planned_end``: with overlap, when the round now training is planned to end, shared with the group.
        ``meet_at``: when the round that just ended was planned to end (DHT time), where its group meets
        (``meeting.py``).
        ``overlapped``: this sync runs while the next round trains; the group stretches that round if its syncs
        take longer (``timing.next_round``).
        """
        self.step_seconds = step_seconds
        if self.state.epoch != self.stuck_epoch:
            self.stuck, self.lonely, self.stuck_epoch = 0, 0, self.state.epoch
        arrival = self.meeting.arrive(meet_at)
        budget += arrival.early
        attempt = _Attempt(tokens, missed_rounds, self.clock.monotonic() + budget, planned_end, meet_at=meet_at,
                           meets=self.clock.monotonic() + arrival.early, overlapped=overlapped)
        result = self._sync(attempt, budget)
        self.meeting.observe(result.group if result.applied else None, result.averaging_seconds)
        result.waited = arrival.slept + arrival.early + arrival.awaited
        result.deadline = arrival.slept + budget + arrival.awaited
        self.stuck = 0 if result.applied or result.rebased else self.stuck + 1
        self.lonely = 0 if self.stuck == 0 or result.outcome in MET_OTHERS else self.lonely + 1
        return result

    def _sync(self, attempt: _Attempt, budget: float) -> SyncResult:
        result = SyncResult()
        try:
            self._decide_and_act(attempt, budget, result)
        except LinkLost as e:  # a helper process of ours died: nothing we wait for will come, nobody hears us
            if not result.applied:  # (a lone step stands, applied before its result could be served)
                result.outcome, result.error = Outcome.LINK_LOST, describe(Outcome.LINK_LOST, str(e))
        if result.outcome is Outcome.GROUP_FINISHED_WITHOUT_US:
            result.applied = True
        result.rebased = result.rebased or result.outcome in REBASED
        if not result.applied:
            self.lineage.return_tokens(attempt.recovered)  # still carried: sent, with its tokens, at our next sync
            # as a delegate without the round's result: our groupmates stop waiting (if they can still hear us)
            if attempt.crossed is not None and result.outcome is not Outcome.LINK_LOST:
                self.transport.give_up_result(*attempt.crossed)
        return result

    def _decide_and_act(self, attempt: _Attempt, budget: float, result: SyncResult) -> None:
        """The loop of ``decide.py`` until it finishes or applies; it ends as soon as this node's link to the swarm is
        lost (its p2p daemon, DHT process or averager died): nobody hears us then, and the peer leaves."""
        self._enter(budget)
        began = self.clock.monotonic()
        result.rebased = self.catchup.catch_up(timeout=max(budget / 3, 5.0)).adopted
        result.catch_up_seconds = self.clock.monotonic() - began
        facts = dict(phase=Phase.BEGIN, caught_up=result.rebased, dropped_resumed=self.lineage.dropped_resumed)
        while True:
            lost = self.transport.link_lost()  # (a part may die between two calls, which then raise nothing)
            if lost:
                raise LinkLost(lost)
            view = self._view(facts, result.attempts, attempt.deadline)
            action = decide(view)
            self._record(action, attempt, result)
            if action.do is Do.FINISH:
                break
            if action.do is Do.STEP_ALONE:
                logger.info(why_alone(view, self.cache.lag))
                self._apply_alone(attempt.tokens, result)
                break
            if action.do is Do.APPLY:
                if action.own_group:  # as a majority group's delegate that met no other: our group's average
                    self.crossing.restore(attempt)
                    self.transport.conclude_group(*attempt.crossed, attempt.group)
                    attempt.averaged = attempt.group
                self._apply(attempt.averaged, result)
                if result.applied:  # the attempt that applied, from its start (or the planned meeting, if later)
                    self.announcer.republish()  # at once: a groupmate whose attempt failed late looks for it (settle)
                    result.averaging_seconds = self.clock.monotonic() - max(attempt.started, attempt.meets)
                    result.allreduce_seconds = attempt.averaged.seconds
                break
            facts = self._act(action, attempt, result, facts)

    def _enter(self, budget: float) -> None:
        """Say we sync (silent until the budget ends, yet alive) and ping who went silent: a healed partition
        reconnects at once, and is noticed mid-round (``RoundClock.watch``)."""
        now = self.clock.dht_time()
        self.announcer.announce(self.announcer.announced["ttl"],
                                **dict(self.announcer.fields(), status=SYNCING, busy_until=now + budget))
        judged = self.catchup.judged_at()
        silent = [pid for pid, r in self.cache.records.items() if not responsive(r, judged)]
        self.transport.reach_out(silent + list(self.initial_peer_ids))
        self.transport.watch(silent)

    def _moved_on(self) -> bool:
        """Does a live peer hold a better state than ours, in records read now?"""
        return bool(peers_ahead(self.catchup.refresh().values(), self.announcer.record(), self.catchup.judged_at()))

    def _view(self, facts: dict, attempts: int, deadline: float) -> View:
        return View(mine=self.announcer.record(), records=tuple(self.cache.records.values()),
                    now=self.catchup.judged_at(), quorum=self.run.quorum, retries=self.config.retries,
                    group_size=self.run.group_size, stuck=self.stuck,
                    attempts=attempts, time_left=deadline - self.clock.monotonic(), lonely=self.lonely,
                    producers=tuple(self.producers()), lookup_failed=self.cache.lookup_failed, **facts)

    def _record(self, action: Action, attempt: _Attempt, result: SyncResult) -> None:
        if action.outcome is None:
            return
        result.outcome, result.error = action.outcome, describe(action.outcome, attempt.detail, action.count)
        if action.outcome is Outcome.LOST_MEMBER:
            logger.warning(result.error)
            if "ConnectionResetError" in attempt.detail and not self.hinted:
                self.hinted = True  # once a run
                hint = socket_queue_hint()
                if hint:
                    logger.warning(hint)

    def _act(self, action: Action, attempt: _Attempt, result: SyncResult, facts: dict) -> dict:
        """Do one action; returns the facts of the view to decide on next."""
        if action.do is Do.LOOK_AT_HOLDERS:
            # or about to: a slow peer ends its round up to one of its steps early. Caught up there, one epoch behind
            # its holders, it took them for training on, finished, and was one epoch behind again at the next meeting
            # (a real run's 6-s-step peers: 5 rounds in a row)
            return dict(facts, holders_syncing=self.catchup.holders_syncing(within=self.grace()), records_fresh=True)
        if action.do is Do.ATTEMPT:
            return self._attempt(action, attempt, result)
        if action.do is Do.AVERAGE:
            return self._average(action, attempt)
        if action.do is Do.SETTLE:
            their_end = attempt.started + self.grace() + self.deadlines.allreduce(1 + attempt.align)
            found, spent = self.catchup.settle(min(attempt.deadline, their_end), attempt.deadline, result.attempts)
            result.attempts += spent
            result.rebased = result.rebased or found.adopted  # (a retry may still apply, at the adopted state)
            return dict(facts, phase=Phase.SETTLED, settled=found.adopted, merged_ours=found.merged_ours)
        if action.do is Do.CATCH_UP:
            found = self.catchup.catch_up(timeout=max(attempt.deadline - self.clock.monotonic(), 1.0))
            result.rebased = result.rebased or found.adopted
            return dict(facts, phase=Phase.CAUGHT_UP, caught_up=found.adopted, holders_syncing=None)
        if action.do is Do.CROSS:
            return self.crossing.cross(action, attempt, self._contribution(action, attempt))
        if action.do is Do.RECEIVE:
            return self.crossing.receive(action, attempt)
        raise AssertionError(f"unhandled action {action.do}")

    def _attempt(self, action: Action, attempt: _Attempt, result: SyncResult) -> dict:
        if action.send_carried:  # deltas carried from a fork we just left go out in this sync: so do their tokens
            attempt.recovered = self.lineage.take_recovered_tokens()
            attempt.tokens += attempt.recovered
        result.attempts += 1
        # every k-th outer step of the fragment this round averages (of the whole model without fragments)
        steps = self.state.epoch // self.outer.fragments.count + 1
        attempt.align = self.has_moment and steps % self.run.align_every == 0
        finite = self.outer.write(attempt.align)
        if finite and action.refresh:  # a retry: who is alive now, not when this sync began
            self.catchup.refresh()
        return dict(phase=Phase.READY, finite=finite)

    def _average(self, action: Action, attempt: _Attempt) -> dict:
        mine, size = self.announcer.record(), 1 + attempt.align
        logger.debug(f"epoch {mine.epoch} {mine.state_hash[:6]}: expecting a group of {action.expected}")
        attempt.started, attempt.tries = self.clock.monotonic(), attempt.tries + 1
        contribution = self._contribution(action, attempt)
        min_group = max(2, self.run.quorum, action.min_group)
        meet_at, grace = attempt.meet_at if attempt.tries == 1 else None, self.grace()  # a retry: from now
        # past our window, our group closed without us if a peer already holds the round's result: stop waiting
        # then, not a matchmaking timeout later (a peer that came 0.3 s late lost 3 short rounds). The records are
        # read only then, once a second: a peer waiting in its window costs the DHT nothing
        window_ends = self.clock.monotonic() + matchmaking_window(self.clock.dht_time(), meet_at, grace, cross=False)
        try:
            self.transport.prepare(mine.epoch, mine.state_hash, min_group, action.target,
                                   allreduce_timeout=self.deadlines.allreduce(size),
                                   part_timeout=self.deadlines.part(size), probe=action.probe,
                                   members=action.members, group=action.group,
                                   meet_at=meet_at, grace=grace)
            self.hooks.at(MATCHMAKING, self.state.epoch)
            contribution = dataclasses.replace(contribution, planned_end=attempt.planned_end())
            attempt.averaged = self.transport.average(
                contribution, contribution.weight, timeout=attempt.deadline - self.clock.monotonic(),
                abandon=lambda: self.clock.monotonic() >= window_ends and self._moved_on())
        except Exception as e:  # a failure of ours (peer/swarm/failures.py), a timeout, or anything else
            attempt.detail = first_line(e)
            return dict(phase=Phase.FAILED, failure=classify(e), expected=action.expected, groups=action.groups)
        self.deadlines.observe(attempt.averaged.seconds, size=size)
        attempt.group, attempt.group_average = attempt.averaged, None
        return dict(phase=Phase.AVERAGED, gathered=attempt.averaged.gathered, groups=action.groups)

    def _contribution(self, action: Action, attempt: _Attempt) -> Contribution:
        """What we tell our group (``swarm/metadata.py``); our weight: our tokens, discounted when stale."""
        mine = self.announcer.record()
        late = catching_up(self.cache.records.values(), mine, self.clock.dht_time(), self.producers()) \
            if attempt.overlapped else []
        return Contribution(epoch=mine.epoch, hash=mine.state_hash, tokens=attempt.tokens, align=attempt.align,
                            step_seconds=self.step_seconds, missed=self.stuck, voters=action.voters,
                            sync_seconds=self.meeting.sync_seconds if attempt.overlapped else None,
                            late=len(late),
                            weight=attempt.tokens * self.run.stale_discount ** attempt.missed_rounds,
                            groups=action.groups, client=self.announcer.identity.client_mode)

    # ---- the outer step ----
    def _apply_alone(self, tokens: int, result: SyncResult) -> None:
        mine = self.announcer.record()
        alone = Contribution(epoch=mine.epoch, hash=mine.state_hash, tokens=tokens, step_seconds=self.step_seconds)
        averaged = Averaged(gathered={mine.peer_id: alone}, aligned=False, seconds=0.0)
        self._apply(averaged, result)
        if not result.applied:
            return
        if any(peer != mine.peer_id for peer in self.cache.records):
            # a swarm's peer behind us (a restart, one that was syncing) replays our step rather than downloading
            # the state: our quantized delta, in the buffers still, is the round's result (none needed alone). Served
            # before our record says we stepped: a replayer that reads it finds the result, or waits for its encoding
            self.transport.serve_alone(mine.epoch, mine.state_hash, averaged)
        self.announcer.republish()

    def _apply(self, averaged: Averaged, result: SyncResult) -> None:
        """The outer step on the averaged pseudo-gradient, bit-identical on every member; the caller republishes."""
        if not self.outer.take(averaged.gathered, self.announcer.identity.peer_id, averaged.aligned,
                               averaged.group_tokens()):
            result.outcome = Outcome.AVERAGE_NOT_FINITE
            result.error = describe(result.outcome)
            return
        result.applied, result.aligned, result.offences = True, averaged.aligned, dict(averaged.offences)
        result.reduced = averaged.reduced
        result.groups = averaged.groups
        result.outcome, result.error = Outcome.APPLIED, None
        result.group, result.group_tokens = tuple(sorted(averaged.gathered)), averaged.group_tokens()
        result.next_round_seconds, result.stretch = next_round(averaged.gathered, self.run.seconds_per_round,
                                                               self.run.round_steps)
        result.round_end = round_end(averaged.gathered)

    # ---- for the node ----
    def producers(self) -> List[str]:
        """The peers whose deltas our state's last outer step merged."""
        return [peer for peer, epoch in self.state.merged.items() if epoch == self.state.epoch - 1]

    def round_budget(self) -> float:
        """The longest this round's sync may block us, retries included, at the current deadlines."""
        return self.config.round_budget(self.grace(), self.deadlines.allreduce())

    def grace(self) -> float:
        return self.meeting.grace()
