"""A training node: round after round, train, sync, report, checkpoint; leave cleanly on every path.

    parts = build_parts(run_flags, node, sync, net, island, hooks)    # peer/round/build.py
    peer = Peer(parts, node, sync, net, island, hooks)
    try:
        peer.join()
        peer.run_rounds()
    finally:
        peer.close()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional, Tuple

from dht.addresses import private_only_hint
from dht.errors import UserError
from dht.manifest import MANIFEST_TTL, listed_name, publish_manifest
from dht.node import visible_maddrs
from peer.config import NodeConfig, SyncConfig
from peer.hooks import INNER, Hooks
from peer.round.build import Parts
from peer.round.checkpoints import Checkpoints
from peer.round.inflight import InFlight, start_overlap, sync_round
from peer.round.metrics import round_record
from peer.round.schedule import RoundClock
from peer.round.stopping import StopOnSignals
from peer.swarm.clock import Clock
from peer.swarm.consensus import LEAVING, active, responsive
from peer.train.island import Island, island_batches
from peer.train.model import count_parameters

logger = logging.getLogger(__name__)
RECORD_TTL = 60.0  # seconds a peer record lives without a refresh (at least)


class Peer:
    def __init__(self, parts: Parts, node: NodeConfig, sync: SyncConfig, island: Optional[Island] = None,
                 hooks: Optional[Hooks] = None):
        self.parts, self.node, self.sync_config, self.net = parts, node, sync, parts.net
        self.island = island  # rank 0 of a torchrun island: the other ranks train alongside, in lockstep
        self.hooks = hooks or Hooks()  # a test harness's fault plan or misbehaviour; no-ops otherwise
        self.run, self.state, self.progress, self.reporter = parts.run, parts.state, parts.progress, parts.reporter
        self.stop_requested = threading.Event()
        self.clock = RoundClock(parts.run, parts.catchup, parts.cache, parts.announcer, parts.transport.answered,
                                Clock(), lambda next_sync_at: self._publish(next_sync_at=next_sync_at))
        self.inflight: Optional[InFlight] = None
        self.clock.sync_in_flight = lambda: self.inflight is not None and self.inflight.running()
        self.manifest_published_at = time.monotonic()
        self.traffic_seen = (0, 0)  # transport bytes counted up to the end of the last round
        self.last_round_seconds: Optional[float] = None
        # what the last round that averaged sent: in our record, for `peer status` (a round that found no group
        # sends nothing, and says nothing about what a round costs on the wire)
        self.last_bytes_sent = 0
        self.last_eval: Tuple[int, Optional[float]] = (-1, None)  # (epoch, held-out loss) of our last evaluation
        self.last_group_size = 0
        # seconds from this process's start to its first inner step; with ``resumed_hash``, in the first record only
        self.startup_seconds: Optional[float] = None
        self.reported = False  # this process wrote its first round record
        # after the last fork of this process (the averager's, in build_parts): its writer thread crosses none
        self.checkpoints = Checkpoints(parts, node, self.hooks, mid_round=island is None)
        # after the averager forked: hivemind ignores SIGINT
        StopOnSignals(self.stop_requested, self.reporter.info, self._leave_stuck,
                      blocked_for=island.blocked_for if island is not None else None)

    def join(self) -> None:
        """Catch up with the swarm, publish our record and say who we are."""
        if self.parts.catchup.catch_up(timeout=60.0).adopted:
            self.reporter.info(f"caught up with the swarm's state: epoch {self.state.epoch}, hash {self.state.hash()}")
        self._drop_resumed_if_merged()
        self._publish()
        say_who_we_are(self.parts, self.node.run_id, self.reporter)
        if self.run.init_from_pretrained and self.state.epoch == 0 and not self.progress.rounds:
            # the level pretrained weights start from (a fresh initialisation's is ln(vocabulary): nothing to say,
            # and an evaluation here delays the first round, which a peer's groupmates wait for)
            self.reporter.info(f"held-out eval of the starting weights: "
                               f"{self.parts.trainer.evaluate(self.parts.eval_batches):.6f}")

    # ------------------------------------------------------------------ run
    def run_rounds(self) -> int:
        """Round after round until stopped. Without overlap, each round's sync runs between two inner phases;
        with ``--overlap`` it runs in the background during the next inner phase, and is joined (reported,
        checkpointed) at that phase's end, before the next sync starts. A peer whose link to the swarm died (its sync
        ends at once: ``SwarmTransport.link_lost``) leaves after its step as a stopped one does, and raises its line."""
        max_rounds, progress = self.node.max_rounds, self.progress
        batches = island_batches(self.parts.stream, self.run.batch_size, self.island)
        while not self._leaving() and not (max_rounds and progress.rounds + bool(self.inflight) >= max_rounds):
            stats = self._inner_phase(batches)
            progress.pending_tokens += stats.tokens
            if stats.steps == 0 or self._leaving():
                break
            progress.pending_rounds += 1
            if self.inflight is not None:
                self._finish(self.inflight)
            self.inflight = self._launch(stats)
            if not self.node.overlap:
                self._finish(self.inflight)
                self.inflight = None
        if self.inflight is not None:  # stopping (or the last round): the sync in flight completes first
            self.clock.planned.set()  # no next round to plan
            self._finish(self.inflight)
            self.inflight = None
        lost = self.parts.transport.link_lost()
        if lost:  # nobody hears us now: no leaving record, no hand-over; ``close`` checkpoints the work
            if self.stop_requested.is_set():  # (systemd stops the daemon with us: all is as asked)
                return 0
            raise UserError(lost)
        self._publish(status=LEAVING)  # nobody counts us in a group now; we still serve our state
        stranded = self.parts.catchup.hand_over()
        if stranded:
            logger.info(f"leaving while {len(stranded)} peer(s) that lack our state could get it from nobody else")
        return 0

    def _leaving(self) -> bool:
        return self.stop_requested.is_set() or self.parts.transport.link_lost() is not None

    def _inner_phase(self, batches):
        """The inner steps of one round, until its planned end; checkpoints mid-round if one is due."""
        run, clock, round_start = self.run, self.clock, time.monotonic()
        steps = clock.begin()
        epoch_at_start = self.state.epoch
        self.reporter.start_round(self.state.epoch, steps if steps < 10**9 else 0)

        def on_step(step: int, loss: float, lr: float) -> None:
            elapsed, tokens = time.monotonic() - round_start, step * run.batch_size * run.seq_len
            self.reporter.step(step, loss, tokens / max(elapsed, 1e-9))
            clock.watch(step)
            # the round so far, should this process die; with overlap once the sync in flight has ended (a sync that
            # runs changes the state under the round)
            if not (self.inflight is not None and self.inflight.running()) and self.checkpoints.due():
                self._checkpoint(round_tokens=tokens, round_steps=step)
            if step == max(1, min(steps, run.round_steps) // 2):
                self.hooks.at(INNER, epoch_at_start)

        def should_stop(steps_done: int) -> bool:  # called before every step
            if self.startup_seconds is None:
                self.startup_seconds = process_age()
            return self._leaving() or clock.over(steps_done)  # (a lost link too: no more steps trained alone)

        stats = self.parts.trainer.train(batches, steps, run.global_step(self.state.epoch), should_stop, on_step)
        if self.island is not None:  # the island's weight: the tokens of all its ranks
            stats.rank_tokens = self.island.end_round(stats.tokens)
            stats.tokens = sum(stats.rank_tokens)
        self.reporter.end_round()
        return stats

    def _launch(self, stats) -> InFlight:
        """Start this round's sync: in the background with overlap (on theta frozen now), else right here."""
        synchronizer, progress, clock, overlap = self.parts.synchronizer, self.progress, self.clock, self.node.overlap
        progress.pending_tokens += self.parts.lineage.take_recovered_tokens()
        step_seconds = clock.step_seconds or stats.compute_seconds / stats.steps
        job = InFlight(stats, progress.pending_tokens, progress.pending_rounds)
        budget = synchronizer.round_budget()
        meet_at = clock.target  # the round that just ended: its planned end, when its group meets
        if overlap:
            start_overlap(self.parts.local, synchronizer, clock)
        job.start(lambda: sync_round(synchronizer, clock, job.tokens, job.rounds, budget, step_seconds, meet_at,
                                     overlap), background=overlap)
        return job

    def _finish(self, job: InFlight) -> None:
        """Join a round's sync; account its tokens, report it, checkpoint."""
        run, progress, wait_start = self.run, self.progress, time.monotonic()
        result = job.wait()
        self.parts.local.thaw()
        sync_seconds = time.monotonic() - (wait_start if self.node.overlap else job.started)
        ended = self.clock.clock.dht_time() - (time.monotonic() - job.finished)  # DHT time the sync returned
        change = self.clock.finish(job.stats.steps, job.stats.compute_seconds, result.next_round_seconds,
                                   anchor=result.round_end if self.node.overlap else None, stretch=result.stretch,
                                   ended=ended)
        if change:
            self.reporter.info(change)
        self._drop_resumed_if_merged()
        if result.applied:
            progress.pending_tokens -= job.tokens
            progress.pending_rounds -= job.rounds
        elif progress.pending_rounds > run.max_staleness:
            self.reporter.info(f"{progress.pending_rounds} rounds of work went unmerged, past --max-staleness "
                               f"{run.max_staleness}: dropping them and resyncing to the global state")
            self.parts.synchronizer.outer.drop_unmerged()
            progress.pending_tokens = progress.pending_rounds = 0
        progress.rounds += 1
        progress.last_loss = job.stats.loss
        self.last_round_seconds = job.stats.compute_seconds + sync_seconds
        eval_loss = self._evaluate_global() if result.applied and self.state.epoch % run.eval_period == 0 else None
        if eval_loss is not None:
            self.last_eval = (self.state.epoch, eval_loss)
        if result.applied:
            self.last_group_size = len(result.group)
        result.rebased = result.rebased or self.clock.rebased
        # every rank of an island holds the same parameters: they are hashed to show it
        island_hashes = self.island.check(self.parts.trainer) if self.island is not None else None
        traffic = self._round_traffic()
        self.last_bytes_sent = traffic[0] or self.last_bytes_sent
        record = round_record(self.parts, job, result, sync_seconds, eval_loss, traffic, overlap=self.node.overlap)
        first, self.reported = not self.reported, True
        record.update(startup_seconds=self.startup_seconds if first else None,
                      resumed_hash=self.parts.resumed_hash if first else None)
        if self.island is not None:
            record.update(island_ranks=self.island.size, island_tokens=job.stats.rank_tokens,
                          island_hashes=island_hashes)
        self.reporter.round(record)
        self._checkpoint()

    def _evaluate_global(self) -> float:
        """Held-out loss of the global parameters G. With overlap the model holds G plus the next round's
        steps, and with fragments the fragments not averaged this round hold their local work, so G is swapped in
        for the evaluation and the model restored after."""
        trainer, layout, eval_batches = self.parts.trainer, self.parts.layout, self.parts.eval_batches
        if not self.node.overlap and self.run.fragments == 1:
            return trainer.evaluate(eval_batches)  # theta == G right after the outer step
        theta = layout.gather(trainer.params, layout.empty())
        layout.scatter(self.state.params, trainer.params)
        try:
            return trainer.evaluate(eval_batches)
        finally:
            layout.scatter(theta, trainer.params)

    def _round_traffic(self) -> Tuple[int, int]:
        """Bytes this peer's averager moved through the transport since the last round ended."""
        sent, received = self.parts.transport.traffic()
        traffic = (sent - self.traffic_seen[0], received - self.traffic_seen[1])
        self.traffic_seen = (sent, received)
        return traffic

    # ------------------------------------------------------------------ publish, checkpoint, close
    def _record_ttl(self) -> float:
        """How long our record outlives its last refresh. The heartbeat thread refreshes it every 2 s, and others
        stop waiting for a dead peer once its heartbeats stop (``consensus.responsive``); this only bounds how
        long a dead peer's record stays in the DHT, its state counted by the fork choice."""
        step = self.clock.step_seconds or 0.0
        return max(RECORD_TTL, 4 * step, self.run.grace_seconds + self.sync_config.allreduce_timeout + 10)

    def _publish(self, status: str = "training", next_sync_at: Optional[float] = None) -> None:
        pace, ranks = self.clock.step_seconds, self.island.size if self.island is not None else 1
        self.parts.announcer.announce(
            self._record_ttl(), status=status, loss=self.progress.last_loss, next_sync_at=next_sync_at,
            round_seconds=self.last_round_seconds, bytes_per_round=self.last_bytes_sent,
            eval_epoch=self.last_eval[0], eval_loss=self.last_eval[1], group_size=self.last_group_size,
            tokens_per_second=self.run.batch_size * self.run.seq_len * ranks / pace if pace else 0.0,
        )
        if time.monotonic() - self.manifest_published_at > MANIFEST_TTL / 4:
            publish_manifest(self.parts.dht, self.parts.manifest,
                             listed_as=listed_name(self.node.run_id, self.parts.namespace))
            self.manifest_published_at = time.monotonic()

    def _drop_resumed_if_merged(self) -> None:
        """The swarm's state holds the work we resumed from our checkpoint (we died after our group merged it,
        before the round's checkpoint): it is not ours to send again (``peer/outer/lineage.py``)."""
        if self.parts.lineage.take_dropped_resumed():
            self.reporter.info(f"the swarm merged the work this peer resumed from its checkpoint before the peer "
                               f"stopped (epoch {self.state.epoch}'s state holds it): not sent again; dropping its "
                               f"{self.progress.pending_tokens:,} tokens of unmerged work (that round's, and any "
                               f"trained on it since)")
            self.progress.pending_tokens = self.progress.pending_rounds = 0

    def _checkpoint(self, round_tokens: int = 0, round_steps: int = 0) -> None:
        """Save everything a restart resumes from (``Checkpoints.save``). With overlap, mid-round: the sync of the last
        round ended and is not joined yet (``_finish``); what it merged is not pending work any more."""
        merged = self.inflight.merged() if round_steps and self.inflight is not None else (0, 0)
        self.checkpoints.save(round_tokens, round_steps, merged)

    def _leave_stuck(self, signal_name: str, where: str) -> None:
        """The training thread is stuck in one native call and cannot take a signal (``peer/round/stopping.py``):
        say where, tell the swarm we left (within seconds), exit. The round in progress is lost; the checkpoint of
        the last round stays."""
        self.reporter.info(f"{signal_name}: the training thread is stuck in {where}: leaving without the round in "
                           f"progress (the last checkpoint stays)")
        self.checkpoints.wait(timeout=5.0)  # the last round's, submitted just before
        telling = threading.Thread(target=self._tell_left, daemon=True)
        telling.start()
        telling.join(timeout=5.0)
        os._exit(1)  # our DHT and averager processes die with us

    def close(self) -> None:
        """Checkpoint (and wait for the write), tell the swarm we left; then ``Parts.close`` stops our processes.
        Safe on any path."""
        try:
            self._checkpoint()
        finally:
            self.checkpoints.close()
        self.parts.transport.stop()
        self._tell_left()

    def _tell_left(self) -> None:
        try:
            self._publish(status="left")
        except Exception as e:  # the p2p daemon may already be gone (Ctrl+C reaches it too)
            logger.debug(f"could not publish our departure: {e!r}")


def process_age() -> Optional[float]:
    """Seconds since this process started: its start time in /proc/self/stat (Linux; clock ticks since boot, so the
    interpreter's own start and the imports count), or None where there is no /proc."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 2)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def say_who_we_are(parts: Parts, run_id: str, reporter) -> None:
    """The lines a peer starts with: whether it created or joined the run, and its reach; what it trains; its
    run key; and the addresses others join with (a warning where all of them are private)."""
    run, net = parts.run, parts.net
    reach = f"reach: {parts.reach.value}"  # what the peers asked at start found (dht/reach.py)
    if parts.created:
        reporter.info(f"created run '{run_id}': no peer of the swarm trained it before | {reach}")
    else:
        records = parts.cache.records or parts.catchup.refresh()  # the catch-up's read may have come too early
        others = [r for r in active(records.values(), parts.manifest.hash) if responsive(r, parts.catchup.judged_at())]
        reporter.info(f"joined run '{run_id}' with {len(others)} live peer(s) | {reach}")
    reporter.info(f"peer {parts.peer_id} | run '{run_id}' ({parts.manifest.hash}) | {run.model}: "
                  f"{count_parameters(parts.trainer.module) / 1e6:.1f}M parameters on {parts.trainer.device} | "
                  f"H={run.inner_steps} | {run.compression}")
    reporter.info(f"run key (joiners may pin the run's creator with --run-key): {parts.manifest.creator}")
    if not net.client_mode:
        reporter.info("others join this run with --initial-peers and one of:")
        maddrs = visible_maddrs(parts.dht)
        for maddr in maddrs:
            print(f"  {maddr}", flush=True)
        hint = private_only_hint(maddrs)  # announced public addresses are among them
        if hint:
            reporter.info(f"warning: {hint}")
