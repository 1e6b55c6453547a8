"""The sync phase of a round, behind one call: catch up, average, apply the outer step.

``Synchronizer.sync(tokens)``:
1. catch up: if the swarm holds a better state (fork choice), download it from its holders, check
   its hash, and rebase the local model onto it, keeping this peer's unmerged work (theta <- G_new - delta);
2. write delta = G - theta (and, every k rounds, AdamW's first moment) into the averager's buffers;
3. matchmaking among the live peers that hold the same (epoch, hash), for at most the grace window,
   then the exact all-reduce, weighted by tokens; a lost member fails the attempt and it is retried
   with the survivors from G and theta, which the attempt never touched;
4. on success, Nesterov on the averaged delta, identical on every member: e <- e+1, theta <- G.
If no group forms, a peer alone (quorum 1) applies its own delta: a lone peer never blocks. With a
larger quorum it applies nothing, keeps training, and its delta keeps growing.

A peer also remembers its own last few deltas. When it adopts a state whose lineage lacks some of
them (it lost a fork), it carries them into its next contribution, so its work is not dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from hivemind.utils import get_dht_time

from compression import get_codec
from compression.feedback import ErrorFeedback
from dht.errors import first_line
from dht.node import reach_out
from dht.records import PeerRecord, RecordPublisher, fetch_records
from peer.averaging.allreduce import MaybeApplied, MinorityGroup, NoMajority
from peer.averaging.averager import SwarmAverager
from peer.config import RunConfig, SyncConfig
from peer.hooks import MATCHMAKING, Hooks
from peer.outer.contributions import Contributions
from peer.outer.nesterov import nesterov_step
from peer.outer.state import GlobalState, merge_contributors, state_hash
from peer.swarm.consensus import (
    MAX_MISSED,
    SYNCING,
    awaiting_state,
    choose_state,
    joining,
    peers_ahead,
    peers_behind,
    peers_with_state,
    responsive,
    syncing_now,
    voters,
)
from peer.swarm.deadlines import Deadlines
from peer.train.flat import FlatLayout
from peer.train.inner import InnerTrainer
from peer.train.local import LocalModel

logger = logging.getLogger(__name__)

NO_GROUP = "could not find a group"
# a round whose sync found the work this peer resumed already merged: that round's work is dropped with it
RESUMED_MERGED = "the swarm had merged the work this peer resumed from its checkpoint; not sent again"
SETTLE_SECONDS, SETTLE_POLL = 2.0, 0.25  # how long a failed member looks for its group's finished state
LOOKUP_TIMEOUT = 2.0  # seconds a look at the swarm's records may block training (a partition slows the DHT)


@dataclass
class SyncResult:
    applied: bool = False
    group: Tuple[str, ...] = ()
    group_tokens: int = 0
    attempts: int = 0
    aligned: bool = False
    rebased: bool = False
    error: Optional[str] = None
    next_round_seconds: Optional[float] = None  # the group's agreed length of the next inner phase
    round_end: Optional[float] = None  # overlap: the group's agreed end (DHT time) of the round in progress
    offences: Dict[str, List[str]] = dataclasses.field(default_factory=dict)  # peer -> its bad parts we reduced


class Synchronizer:
    def __init__(self, *, averager: SwarmAverager, dht, run_id: str, manifest_hash: str, peer_id: str,
                 state: GlobalState, trainer: InnerTrainer, layout: FlatLayout, run: RunConfig,
                 sync: SyncConfig, delta: torch.Tensor, moment: Optional[torch.Tensor], lock: threading.Lock,
                 client_mode: bool, feedback: Optional[ErrorFeedback] = None,
                 hooks: Optional[Hooks] = None, initial_peer_ids: Tuple[str, ...] = (),
                 local: Optional[LocalModel] = None):
        self.averager, self.dht, self.run_id, self.manifest_hash = averager, dht, run_id, manifest_hash
        self.peer_id, self.state, self.trainer, self.layout = peer_id, state, trainer, layout
        self.local = local or LocalModel(trainer, layout)  # theta as this sync sees it (overlap: frozen)
        self.run, self.config, self.delta, self.moment, self.lock = run, sync, delta, moment, lock
        self.client_mode, self.hooks, self.initial_peer_ids = client_mode, hooks or Hooks(), initial_peer_ids
        self.deadlines = Deadlines(ceiling=sync.allreduce_timeout, floor=sync.deadline_floor,
                                   factor=sync.deadline_factor, part_ceiling=sync.part_timeout)
        self.feedback = feedback or ErrorFeedback(get_codec("none"), 0)
        self.records: Dict[str, PeerRecord] = {}
        self.publisher = RecordPublisher(dht, run_id)
        self.announced: dict = dict(ttl=60.0)
        self.step_seconds: Optional[float] = None
        self.merged_ours = False
        self.unreachable = False  # the last catch_up saw a better state but could download it from none of its holders
        self.contributions = Contributions(self.feedback.codec, run.max_staleness)
        self.recovered_tokens = 0  # tokens behind deltas carried over from a fork we left, not yet re-sent
        self.carried: Optional[torch.Tensor] = None  # those deltas, summed: sent with our next contribution
        # a restart's unmerged work (from its checkpoint) was trained on G at this epoch; until it is sent or
        # found merged. ``dropped_resumed``: the swarm had merged it already, so theta was reset to its state
        self.resumed_epoch: Optional[int] = None
        self.dropped_resumed = False
        self.lookup_failed = False  # the last look at the swarm's records timed out: what we know may be stale
        # rounds in a row we sat at this epoch without applying: what the escapes from waiting count (not the
        # unmerged rounds, which include rounds lost catching up; a peer that just adopted the swarm's state is
        # not stalled, and once counted as such it forked a majority still at work)
        self.stuck, self.stuck_epoch = 0, -1
        # overlap: when the round in progress is planned to end (DHT time), shared with the group (``_round_end``)
        self.planned_end: Callable[[], Optional[float]] = lambda: None

    # ---- the swarm's view ----
    def my_record(self, **fields) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, epoch=self.state.epoch, state_hash=self.state.hash(),
                          tokens_total=self.state.tokens_total, manifest_hash=self.manifest_hash,
                          client_mode=self.client_mode, **fields)

    def refresh(self) -> Dict[str, PeerRecord]:
        # a lookup may miss records that the DHT holds only on nodes it cannot reach now (a partition):
        # records seen before stay known until they expire, as they would in the DHT
        now = get_dht_time()
        # a lookup crosses several DHT hops: on slow links allow it what a matchmaking request may take
        fetched = fetch_records(self.dht, self.run_id, timeout=max(LOOKUP_TIMEOUT, self.config.request_timeout))
        self.lookup_failed = fetched is None
        fetched = fetched or {}
        known = {pid: r for pid, r in self.records.items() if r.expires_at > now}
        for pid, record in fetched.items():  # a node cut off for a while may return an older version
            if pid != self.peer_id and (pid not in known or record.expires_at >= known[pid].expires_at):
                known[pid] = record
        self.records = known
        return self.records

    def announce(self, ttl: float, **fields) -> None:
        """Publish our record with these fields (schedule, loss, speed, status); re-sent after a rebase."""
        self.announced = dict(fields, ttl=ttl)
        self._republish()

    def fields(self) -> dict:
        """The fields last announced (without the ttl)."""
        return {k: v for k, v in self.announced.items() if k != "ttl"}

    def _republish(self) -> None:
        self.publisher.publish(self.my_record(**self.fields()), self.announced["ttl"])

    # ---- catch-up ----
    def catch_up(self, timeout: float, attempted_epoch: Optional[int] = None) -> bool:
        """Adopt the swarm's best state if it beats ours; True if we rebased onto it.

        ``attempted_epoch``: we just sent our delta in an all-reduce at this epoch that failed for us.
        If the adopted state says it merged our delta at that epoch, the group finished without us
        (a member's results reached the others but not us): then our work is in, and carrying it
        again would count it twice; ``self.merged_ours`` tells the caller.
        """
        self.merged_ours, self.unreachable = False, False
        best = choose_state(self.refresh().values(), self.my_record())
        if best is None:
            return False
        donors = [r.peer_id for r in self.records.values() if r.state_hash == best.state_hash and not r.client_mode]
        logger.info(f"swarm is at epoch {best.epoch} ({best.state_hash[:8]}), we are at {self.state.epoch}: "
                    f"downloading the state from {len(donors)} peer(s)")
        self._adopting(best.state_hash)  # its holders' next group expects us (``consensus.joining``)
        try:
            downloaded = self.averager.download_state(donors, best.state_hash, timeout=timeout,
                                                      part_timeout=self.deadlines.part())
            if downloaded is None:
                self.unreachable = True
                logger.warning("could not download the swarm's state from any holder; training on ours for now")
                return False
            used, metadata, tensors = downloaded
            if not self.adopt(metadata, tensors, attempted_epoch):
                logger.warning(f"the state from {', '.join(used)} fails its hash check; ignored")
                return False
            logger.info(f"adopted epoch {self.state.epoch} ({self.state.hash()[:8]}), downloaded from "
                        f"{len(used)} peer(s)")
            return True
        finally:
            self._adopting(None)  # republished at once, with the state we adopted if we did: others count us

    def _adopting(self, state_hash: Optional[str]) -> None:
        fields = {k: v for k, v in self.fields().items() if k != "adopting"}
        self.announce(self.announced["ttl"], **fields, **({"adopting": state_hash} if state_hash else {}))

    def holders_syncing(self) -> bool:
        """Just after adopting a state: are its holders in a sync now (``consensus.syncing_now``)? A fresh look:
        the records read before the download predate it."""
        return bool(syncing_now(self.refresh().values(), self.my_record()))

    def adopt(self, metadata: dict, tensors: List[torch.Tensor], attempted_epoch: Optional[int] = None) -> bool:
        """Verify a downloaded (G, m, e) against its hash and rebase onto it.

        theta <- G_new - (G - theta), or theta <- G_new if the new lineage merged the delta we attempted at
        ``attempted_epoch``. Our own deltas that only the lineage we leave merged go into ``carried``: our next
        contribution sends them. (Shifting theta by them instead once started a round several rounds' work
        away from any trained point: its loss jumped from 2.65 to 4.78.)
        """
        try:
            params, momentum = (t.to(torch.float32).reshape(-1).contiguous() for t in tensors)
            epoch, tokens_total, claimed = int(metadata["epoch"]), int(metadata["tokens_total"]), metadata["hash"]
            merged = {str(k): int(v) for k, v in dict(metadata.get("merged", {})).items()}
        except (KeyError, TypeError, ValueError):
            return False
        if params.numel() != self.layout.numel or momentum.numel() != self.layout.numel:
            return False
        if state_hash(params, momentum, epoch) != claimed:
            return False
        mine_merged = merged.get(self.peer_id, -1)
        resumed, self.resumed_epoch = self.resumed_epoch, None
        with self.lock:
            if attempted_epoch is not None and mine_merged == attempted_epoch:
                self.merged_ours = True
                self.feedback.commit(self._own_delta())  # what we sent, carried deltas included: merged
                self.carried = None
                self.local.set(params)
            elif resumed is not None and mine_merged >= resumed:
                # we restarted from a checkpoint written before our group merged this work (the process died in
                # between, say while writing the round's checkpoint): sending it again would count it twice
                self.dropped_resumed = True
                self.carried, self.recovered_tokens = None, 0
                self.local.set(params)
            else:
                if self.contributions.unmerged(mine_merged):
                    if self.carried is None:
                        self.carried = torch.zeros_like(params)
                    self.recovered_tokens += self.contributions.carry_into(self.carried, mine_merged)
                self.local.shift(params - self.state.params)
            self.contributions.clear()
            self.state.params, self.state.momentum = params, momentum
            self.state.epoch, self.state.tokens_total, self.state.merged = epoch, tokens_total, merged
        return True

    # ---- one round ----
    def sync(self, tokens: int, budget: float, missed_rounds: int = 0,
             step_seconds: Optional[float] = None) -> SyncResult:
        """Average this round's work with the peers that hold our state; see the module docstring.

        ``missed_rounds``: rounds in a row this peer's work went unmerged; it weighs
        tokens x stale_discount^missed_rounds in the average (DESIGN.md step 6). A peer that misses a group
        while others hold its state does not step alone (that would fork the run); it catches up and
        contributes later. Only after MAX_MISSED rounds stuck at its state (``self.stuck``), and with no other
        responsive peer at its state, does a quorum-1 peer go on alone.
        ``step_seconds``: this peer's recent seconds per inner step, shared with the group so that every
        member computes the same length for the next round (H steps of the median member).
        """
        self.step_seconds = step_seconds
        if self.state.epoch != self.stuck_epoch:
            self.stuck, self.stuck_epoch = 0, self.state.epoch
        result = self._sync(tokens, budget, missed_rounds)
        self.stuck = 0 if result.applied or result.rebased else self.stuck + 1
        return result

    def _sync(self, tokens: int, budget: float, missed_rounds: int) -> SyncResult:
        result, deadline = SyncResult(), time.monotonic() + budget
        syncing = dict(self.fields(), status=SYNCING, busy_until=get_dht_time() + budget)
        self.announce(self.announced["ttl"], **syncing)  # silent until then, yet alive
        silent = [pid for pid, r in self.records.items() if not responsive(r, get_dht_time())]
        reach_out(self.dht, silent + list(self.initial_peer_ids))  # a healed partition reconnects at once
        self.publisher.reach = tuple(silent)  # and is noticed mid-round (``RoundClock.watch``)
        result.rebased = self.catch_up(timeout=max(budget / 3, 5.0))
        recovered = 0
        if self.dropped_resumed:  # ``tokens`` counts the work we just found merged: contribute at the next sync
            result.error = RESUMED_MERGED
            return result
        if result.rebased:
            if not self.holders_syncing():
                # The peers holding the state we just adopted are training towards their next sync: keep training
                # on top of their state and contribute then (our next round lines up with it). If they are syncing
                # now, they may be waiting for us (our record said we were downloading their state): join them.
                result.error = "caught up with the swarm; contributing at its next sync"
                return result
            # deltas carried from a fork we just left go out in this sync (``_own_delta``): so do their tokens
            recovered = self.take_recovered_tokens()
            tokens += recovered
        just_read = False  # whether the records were read since the last attempt
        while result.attempts <= self.config.retries and time.monotonic() < deadline:
            result.attempts += 1
            align = bool(self.moment is not None and (self.state.epoch + 1) % self.run.align_every == 0)
            if not self._fill_buffers(align):
                result.error = "local pseudo-gradient is not finite: dropped this round's work"
                break
            if result.attempts > 1 and not just_read:  # a retry: who is alive now, not when this sync began
                self.refresh()
            just_read = False
            mine = self.my_record()  # one state hash per attempt: hashing G and m is a pass over 2 x the model
            records = self.records.values()  # the peers at our state, and those downloading it: they join us
            holders = peers_with_state(records, mine)
            expected = 1 + len(holders) + len(joining(records, mine))
            logger.debug(f"epoch {mine.epoch} {mine.state_hash[:6]}: expecting a group of {expected}; "
                         f"records {[(r.peer_id[-4:], r.epoch, r.state_hash[:6]) for r in self.records.values()]}")
            if expected == 1:  # nobody else holds our state: no one to average with now
                behind = peers_behind(self.records.values(), mine)
                if self.lookup_failed and self.stuck + 1 < MAX_MISSED:
                    # we could not read the swarm's records in time (slow links, a partition): stepping alone on
                    # a view that may be empty only because it is late would fork the run
                    result.error = "could not read the swarm's records in time; contributing next round"
                elif behind and self.stuck + 1 < MAX_MISSED:
                    # they adopt our state at their next round (or their records are stale, as in a
                    # partition): stepping alone now would fork the run; contribute with them next round
                    result.error = f"the {len(behind)} other live peer(s) are behind us; contributing next round"
                else:
                    self._apply_alone(tokens, result, mine)
                break
            attempt_started = time.monotonic()
            try:
                # a holder killed just now still has a fresh record: ask the network whether it is gone
                self.averager.prepare_round(mine.epoch, mine.state_hash, max(2, self.run.quorum), expected,
                                            allreduce_timeout=self.deadlines.allreduce(1 + align),
                                            part_timeout=self.deadlines.part(1 + align),
                                            probe=[r.peer_id for r in holders if not r.client_mode])
                outcome = self._average(tokens, tokens * self.run.stale_discount ** missed_rounds, align, deadline,
                                        mine)
            except Exception as e:  # AllreduceException, TimeoutError, or anything the averager process hit
                their_end = attempt_started + self.run.grace_seconds + self.deadlines.allreduce(1 + align)
                if isinstance(e, MinorityGroup):  # the larger group applies this round: adopt its state when it does
                    if not isinstance(e, NoMajority) and self._settle(min(deadline, their_end), deadline, result):
                        result.rebased = True
                        result.error = f"{e}: adopted the larger group's state, contributing at its next sync"
                    else:
                        result.error = f"{e}: not applied; contributing next round"
                    break
                if NO_GROUP not in str(e):
                    result.error = f"all-reduce failed ({first_line(e)}); retrying with the survivors"
                    logger.warning(result.error)
                    # others may still be receiving their last parts: look for their new state for as long as
                    # their all-reduce may take, before averaging our delta again into a different state
                    if isinstance(e, MaybeApplied) and self._settle(min(deadline, their_end), deadline, result) \
                            and self.merged_ours:
                        result.applied, result.rebased = True, True
                        result.error = "our group finished without us, with our delta merged: adopted its state"
                        break
                    continue
                if self.catch_up(timeout=max(deadline - time.monotonic(), 1.0)):
                    result.rebased = True
                    result.error = "missed the group; caught up, contributing at the next sync"
                elif result.attempts <= self.config.retries and self.holders_syncing():
                    # the peers at our state began their sync after our matchmaking gave up on them (we had just
                    # adopted it and read a holder's record from its own catch-up a moment ago): they count on us
                    # now (``consensus.peers_with_state``); a round of ours first would miss their group
                    just_read = True  # holders_syncing read the records just now
                    continue
                elif self.stuck + 1 >= MAX_MISSED and voters(self.records.values(), mine) == 1:
                    self._apply_alone(tokens, result, mine)  # the others at our state went silent: we are alone
                else:  # stepping alone while others at our state are alive would fork the run (a minority of 1)
                    result.error = f"no group formed with the {expected - 1} peer(s) at our state; retrying next round"
                break
            self.deadlines.observe(outcome.get("seconds", 0.0), size=1 + align)
            self._apply(outcome, result)
            break
        if not result.applied:
            self.recovered_tokens += recovered  # still carried: sent, with its tokens, at our next sync
        return result

    def outer_lr(self) -> float:
        """The outer lr of the step from our epoch to the next."""
        return self.run.outer_lr_at(self.state.epoch * self.run.inner_steps)

    def producers(self) -> List[str]:
        """The peers whose deltas our state's last outer step merged."""
        return [peer for peer, epoch in self.state.merged.items() if epoch == self.state.epoch - 1]

    def eager_target(self) -> torch.Tensor:
        """With overlap, where the next round starts: the outer step we would take with our own pseudo-gradient
        (from theta as frozen at the round's end) in place of the group's average (peer/local.py)."""
        params, momentum = self.state.params.clone(), self.state.momentum.clone()
        own_delta = torch.sub(params, self.local.gather(self.layout.empty()))
        nesterov_step(params, momentum, own_delta, self.outer_lr(), self.run.outer_momentum)
        return params

    def take_dropped_resumed(self) -> bool:
        """Did an adoption find the work we resumed from a checkpoint merged already (``adopt``)? Once."""
        dropped, self.dropped_resumed = self.dropped_resumed, False
        return dropped

    def take_recovered_tokens(self) -> int:
        """Tokens of our work carried over from a losing fork: the caller adds them to its next contribution."""
        tokens, self.recovered_tokens = self.recovered_tokens, 0
        return tokens

    def _settle(self, their_end: float, deadline: float, result: SyncResult) -> bool:
        """After an attempt that failed for us once our reducer had finished: did some groupmate finish it?
        (Also after a minority group: when does the majority's state appear?)
        A lost reducer, or a deadline that fired on us first, can fail the all-reduce for us after the others
        received every part and applied it. Retrying at once would average our delta a second time, into a
        different state (a fork). So first look for a groupmate's new state (members publish it as soon as
        they apply) until SETTLE_SECONDS past ``their_end``, when the last of them must have finished or failed
        too, and adopt it if it appears; True if we did.

        If by then we see that state but none of its holders answers (a reducer that finished the round, then lost its
        link), we spend our next attempt's time (``result.attempts``, within ``deadline``) trying again: its link may
        come back, and averaging again without it forks the run until fork choice joins the two states. (Measured: a
        6-s cut at a reducer's reduce phase; the others' download from it timed out in TCP's retransmission backoff
        after the link was back, and they retried as a pair, so the round's group held two states for a round.)"""
        attempted = self.state.epoch
        settle_until = max(time.monotonic(), their_end) + SETTLE_SECONDS
        extended = False
        while True:
            if self.catch_up(timeout=max(settle_until - time.monotonic(), 1.0), attempted_epoch=attempted):
                return True
            now = time.monotonic()
            if now >= settle_until:
                if extended or not self.unreachable or result.attempts > self.config.retries or now >= deadline:
                    return False
                extended, result.attempts = True, result.attempts + 1
                settle_until = min(deadline, now + self.run.grace_seconds + self.deadlines.allreduce() + SETTLE_SECONDS)
                logger.info("our group's new state is held by peers that do not answer now; trying again for "
                            f"{settle_until - now:.0f}s before averaging without them")
                continue
            time.sleep(SETTLE_POLL)

    def hand_over(self) -> List[str]:
        """Before leaving (our record says ``LEAVING``): stay, serving our state, while peers that lack it could get
        it from nobody else (``consensus.awaiting_state``), for at most as long as a member may look for its
        group's state (``_settle``: grace + all-reduce deadline + SETTLE_SECONDS). Returns those still without it."""
        timeout = self.run.grace_seconds + self.deadlines.allreduce() + SETTLE_SECONDS
        mine, deadline = self.my_record(), time.monotonic() + timeout
        while True:
            missing = awaiting_state(self.refresh().values(), mine)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(SETTLE_POLL)

    def round_budget(self) -> float:
        """The longest this round's sync may block us, retries included, at the current deadlines."""
        return self.config.round_budget(self.run.grace_seconds, self.deadlines.allreduce())

    def drop_unmerged(self) -> None:
        """Past the staleness bound: forget our unmerged work and train from the global state again."""
        with self.lock:
            self.local.set(self.state.params)
            self.contributions.clear()
            self.carried = None

    def _next_round_seconds(self, gathered: dict) -> Optional[float]:
        """Every member computes this from the same gathered data, so the group starts its next round
        with one shared length: --round-seconds, or H steps at the median member's pace."""
        if self.run.round_seconds:
            return self.run.round_seconds
        paces = [float(info["step_seconds"]) for info in gathered.values()
                 if isinstance(info.get("step_seconds"), (int, float)) and info["step_seconds"] > 0]
        return self.run.inner_steps * statistics.median(paces) if paces else None

    @staticmethod
    def _round_end(gathered: dict) -> Optional[float]:
        """With overlap, the round after this sync's is already running on each member, planned to end when its
        own clock said. Every member takes the median of those plans, from the same gathered data: the group ends
        that round together, and its drift (each member's round had started from its own clock) is undone every
        round instead of adding up until a member misses its group."""
        plans = [float(info["planned_end"]) for info in gathered.values()
                 if isinstance(info.get("planned_end"), (int, float))]
        return statistics.median(plans) if plans else None

    def _apply_alone(self, tokens: int, result: SyncResult, mine: PeerRecord) -> None:
        """No group: a quorum-1 peer's own delta is its outer step; with a larger quorum, wait. Never while a live
        peer holds a better state: our download of it failed (in a rehearsal all its holders moved on during it),
        and a step of our own would fork the run and lose the fork choice; we catch up next round instead."""
        ahead = peers_ahead(self.records.values(), mine)
        if ahead:
            result.error = f"{len(ahead)} live peer(s) hold a better state; catching up next round"
            return
        if self.run.quorum > 1:
            result.error = f"no group of at least {self.run.quorum} peers formed"
            return
        outcome = dict(gathered={self.peer_id: dict(tokens=tokens, step_seconds=self.step_seconds)}, aligned=False)
        self._apply(outcome, result)

    def _fill_buffers(self, align: bool) -> bool:
        with self.averager.get_tensors():
            self._own_delta(out=self.delta)
            if align:
                self.local.gather_moments(self.moment)
            if torch.isfinite(self.delta).all():
                self.feedback.quantize(self.delta, out=self.delta)  # what we send: delta + residual, quantized
                self.hooks.outgoing(self.delta)
                return True
        logger.error("the local model diverged (non-finite pseudo-gradient); resetting it to the global state")
        self.local.set(self.state.params)
        return False

    def _own_delta(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Our unmerged work: G - theta, plus the deltas carried from a fork we left."""
        out = self.local.gather(self.layout.empty() if out is None else out)
        torch.sub(self.state.params, out, out=out)
        if self.carried is not None:
            out.add_(self.carried)
        return out

    def _average(self, tokens: int, weight: float, align: bool, deadline: float, mine: PeerRecord) -> dict:
        grace = self.run.grace_seconds
        self.hooks.at(MATCHMAKING, self.state.epoch)
        gather = dict(epoch=mine.epoch, hash=mine.state_hash, tokens=tokens, align=align,
                      step_seconds=self.step_seconds, missed=self.stuck,
                      voters=voters(self.records.values(), mine, producers=self.producers()),
                      planned_end=self.planned_end())
        control = self.averager.step(
            gather=gather, weight=float(weight), scheduled_time=get_dht_time() + grace,
            timeout=grace + self.averager.matchmaking_kwargs["request_timeout"] + 1.0, allow_retries=False, wait=False,
        )
        try:
            return control.result(timeout=max(deadline - time.monotonic(), 0.1))
        except TimeoutError:
            control.cancel()
            raise TimeoutError("the sync deadline passed") from None

    def _apply(self, outcome: dict, result: SyncResult) -> None:
        gathered = outcome["gathered"]
        mine = (self.state.epoch, self.state.hash())
        if any((info.get("epoch", mine[0]), info.get("hash", mine[1])) != mine for info in gathered.values()):
            result.error = "a groupmate held a different state; not applied"  # round keys make this unreachable
            return
        own_delta = self._own_delta()  # our delta again: the buffer now holds the average
        self.feedback.commit(own_delta)  # own_delta becomes what we sent; the residual keeps the rest
        with self.lock, self.averager.get_tensors():
            if not torch.isfinite(self.delta).all():
                result.error = "the averaged pseudo-gradient is not finite; not applied"
                return
            self.contributions.remember(self.state.epoch, own_delta, int(gathered[self.peer_id]["tokens"]))
            nesterov_step(self.state.params, self.state.momentum, self.delta, self.outer_lr(),
                          self.run.outer_momentum)
            if outcome["aligned"]:
                self.local.load_first_moments([view for _, view in self.layout.slices(self.moment)])
            self.state.merged = merge_contributors(self.state.merged, gathered, self.state.epoch)
            self.resumed_epoch = None  # sent and merged, whatever a restart resumed with
            self.state.epoch += 1
            self.state.tokens_total += sum(int(info["tokens"]) for info in gathered.values())
            self.local.set(self.state.params)  # theta <- G (with overlap: plus the steps taken since)
            self.carried = None  # merged with the rest of our delta
        result.applied, result.aligned = True, outcome["aligned"]
        result.offences = dict(outcome.get("offences", {}))
        result.group = tuple(sorted(gathered))
        result.group_tokens = sum(int(info["tokens"]) for info in gathered.values())
        result.next_round_seconds = self._next_round_seconds(gathered)
        result.round_end = self._round_end(gathered)
        self._republish()  # at once: a groupmate whose attempt failed late looks for this state (``_settle``)
