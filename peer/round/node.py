"""A training node: build it from its configs, run it round by round, close it on every path.

    peer = Peer(run_flags, node, sync, net)
    try:
        peer.build()
        peer.run_rounds()
    finally:
        peer.close()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any, Dict, Optional

import torch

from compression import get_codec
from compression.feedback import ErrorFeedback, roundtrip
from dht.addresses import parse_maddrs
from dht.errors import UserError
from dht.manifest import MANIFEST_TTL, RunManifest, join_or_create, publish_manifest, run_namespace
from dht.node import DHTConfig, signing_identity, start_dht, visible_maddrs
from dht.validation import run_validators
from peer.averaging.averager import SwarmAverager
from peer.config import NodeConfig, RunConfig, SyncConfig
from peer.hooks import CHECKPOINT, INNER, Hooks
from peer.ops.checkpoint import load_checkpoint, save_checkpoint
from peer.ops.report import Reporter
from peer.ops.trackers import Trackers
from peer.outer.state import GlobalState
from peer.round.schedule import RoundClock
from peer.round.sync import Synchronizer, SyncResult
from peer.swarm.consensus import LEAVING
from peer.train.build import build_trainer
from peer.train.flat import FlatLayout
from peer.train.island import Island, island_batches
from peer.train.local import LocalModel
from peer.train.model import count_parameters

logger = logging.getLogger(__name__)
RECORD_TTL = 60.0  # seconds a peer record lives without a refresh (at least)


class Peer:
    def __init__(self, run_flags: Dict[str, Any], node: NodeConfig, sync: SyncConfig, net: DHTConfig,
                 island: Optional[Island] = None, hooks: Optional[Hooks] = None):
        self.run_flags, self.node, self.sync_config, self.net = run_flags, node, sync, net
        self.island = island  # rank 0 of a torchrun island: the other ranks train alongside, in lockstep
        self.reporter = Reporter(node.metrics_file, node.quiet)
        self.hooks = hooks or Hooks()  # a test harness's fault plan or misbehaviour; no-ops otherwise
        # the name of the run's DHT and matchmaking keys: secret for a private run (--run-token)
        self.namespace = run_namespace(node.run_id, node.run_token or os.environ.get("DILOCO_RUN_TOKEN"))
        self.stop_requested = threading.Event()
        self.lock = threading.Lock()  # guards the global state against a concurrent download by a peer
        self.dht = self.averager = self.synchronizer = self.clock = None
        self.rounds = self.pending_tokens = self.pending_rounds = 0
        self.last_loss: Optional[float] = None
        self.last_round_seconds: Optional[float] = None
        self.manifest_published_at = 0.0
        self.checkpointed_at = time.monotonic()
        self.traffic_seen = (0, 0)  # transport bytes counted up to the end of the last round
        # what the last round that averaged sent: in our record, for `peer status` (a round that found no group
        # sends nothing, and says nothing about what a round costs on the wire)
        self.last_bytes_sent = 0

    # ------------------------------------------------------------------ build
    def build(self) -> None:
        if self.node.threads:
            torch.set_num_threads(self.node.threads)
        payload = None
        net = self.net
        if self.node.checkpoint_dir:
            os.makedirs(self.node.checkpoint_dir, exist_ok=True)
            payload = load_checkpoint(self.node.checkpoint_dir)  # a corrupt file fails here, before any network
            if net.identity_path is None:
                net = dataclasses.replace(net, identity_path=os.path.join(self.node.checkpoint_dir, "identity.key"))
        net, fresh = signing_identity(net)  # our records are signed with our peer id's own key
        self.dht = start_dht(net, run_validators(self.namespace), check_identity=not fresh)
        self.peer_id = self.dht.peer_id.to_base58()
        self.manifest = self._resolve_manifest(payload)
        self.run = run = RunConfig.from_settings(dict(self.manifest.settings))
        self.reporter.trackers = Trackers.from_flags(self.node.tensorboard, self.node.wandb,
                                                     name=f"{self.node.run_id}-{self.peer_id[-8:]}",
                                                     config=dict(self.manifest.settings, peer_id=self.peer_id))

        if self.island is not None:  # the other ranks build the same trainer from the same settings
            self.island.share(dict(settings=dict(self.manifest.settings), shard_key=self.peer_id))
        self.corpus, self.trainer = build_trainer(run, self.node, self.island)
        device, model = self.trainer.device, self.trainer.module
        self.eval_batches = self.corpus.eval_batches(run.eval_batches, run.batch_size)
        self.layout = FlatLayout(self.trainer.params)
        params = self.layout.gather(self.trainer.params, self.layout.empty())
        self.state = GlobalState(params=params, momentum=self.layout.empty())
        position = 0
        if payload is not None:
            position = self._restore(payload)
        self.stream = self.corpus.stream(run.seed, self.peer_id, position)
        if self.island is not None:
            self.island.share(position)

        self.delta = self.layout.empty(shared=True)
        self.moment = self.layout.empty(shared=True) if run.align_every else None
        codec = get_codec(run.compression)
        # encode once now: the first use imports bitsandbytes and self-checks its decoder (seconds on a busy
        # machine), which inside the first all-reduce would run past the part deadline; the averager
        # process, forked below, inherits the warm codec
        roundtrip(codec, torch.zeros(1 << 12))
        self.feedback = ErrorFeedback(codec, self.layout.numel, enabled=run.error_feedback)
        if payload is not None and self.feedback.residual is not None and payload.get("residual") is not None:
            self.feedback.residual.copy_(payload["residual"])
        self.averager = SwarmAverager(
            self.delta, self.moment, self.dht, prefix=f"{self.namespace}_{self.manifest.hash}", codec=codec,
            state_provider=self._share_state, quorum=run.quorum, grace_seconds=run.grace_seconds,
            request_timeout=self.sync_config.request_timeout, allreduce_timeout=self.sync_config.allreduce_timeout,
            part_timeout=self.sync_config.part_timeout, client_mode=net.client_mode,
            hooks=self.hooks, clip_factor=run.clip_factor, ban_after=run.ban_after,
        )
        self.averager.run_in_background(await_ready=True)
        self.install_signal_handlers()  # hivemind ignores SIGINT in the parent while it forks
        self.local = LocalModel(self.trainer, self.layout)
        self.synchronizer = Synchronizer(
            averager=self.averager, dht=self.dht, run_id=self.namespace, manifest_hash=self.manifest.hash,
            peer_id=self.peer_id, state=self.state, trainer=self.trainer, layout=self.layout, run=run,
            sync=self.sync_config, delta=self.delta, moment=self.moment, lock=self.lock,
            client_mode=net.client_mode, feedback=self.feedback,
            hooks=self.hooks,
            initial_peer_ids=tuple(m["p2p"] for m in parse_maddrs(net.initial_peers, flag="--initial-peers",
                                                                   need_peer_id=True)),
            local=self.local,
        )
        if payload is not None:  # deltas carried from a fork we left, not sent yet
            self.synchronizer.carried = payload.get("carried")
            self.synchronizer.recovered_tokens = int(payload.get("recovered_tokens", 0))
            if self.pending_tokens:  # unmerged work, trained on G at this epoch: our group may have merged it since
                self.synchronizer.resumed_epoch = self.state.epoch
        self.clock = RoundClock(run, self.synchronizer, lambda next_sync_at: self._publish(next_sync_at=next_sync_at))
        if self.node.overlap:
            self.synchronizer.planned_end = lambda: self.clock.target
        if self.synchronizer.catch_up(timeout=60.0):
            self.reporter.info(f"downloaded the swarm's state: epoch {self.state.epoch}, hash {self.state.hash()}")
        self._drop_resumed_if_merged()
        self._publish()
        self._announce(count_parameters(model), device)

    def _resolve_manifest(self, payload: Optional[dict]) -> RunManifest:
        """The run's manifest: the swarm's if it has one, else ours (from the checkpoint or the flags)."""
        run_id = self.node.run_id
        if payload is not None:
            proposal = RunManifest.from_record(self.namespace, payload.get("manifest_record"))
            if proposal is None:
                raise UserError(f"checkpoint in {self.node.checkpoint_dir} holds no valid signed run manifest (an "
                                f"older format?); use another --checkpoint-dir")
        else:
            proposal = RunManifest(self.namespace, RunConfig(**self.run_flags).to_settings())
        if self.net.initial_peers:
            manifest = join_or_create(self.dht, proposal, self.node.run_key)
        else:
            manifest = proposal if proposal.verified() else proposal.signed()
            if self.node.run_key is not None and manifest.creator != self.node.run_key.strip():
                raise UserError("--run-key names another creator, but this peer starts the run itself (no "
                                "--initial-peers): drop --run-key, or pass the run's --initial-peers")
            publish_manifest(self.dht, manifest)
        self.manifest_published_at = time.monotonic()
        for name, value in self.run_flags.items():
            if manifest.settings.get(name) != value:
                raise UserError(
                    f"--{name.replace('_', '-')} {value} conflicts with run '{run_id}', which uses "
                    f"{name}={manifest.settings.get(name)}; drop the flag to join it, or pass another --run-id "
                    f"to start a new run"
                )
        if payload is not None and payload["manifest_hash"] != manifest.hash:
            raise UserError(
                f"checkpoint in {self.node.checkpoint_dir} belongs to another configuration of run '{run_id}' "
                f"(manifest {payload['manifest_hash']}, the swarm's is {manifest.hash}); use another --checkpoint-dir"
            )
        return manifest

    def _restore(self, payload: dict) -> int:
        """Resume epoch, outer state, inner model and optimizer, and data position from a checkpoint."""
        self.state.params.copy_(payload["params"])
        self.state.momentum.copy_(payload["momentum"])
        self.state.epoch, self.state.tokens_total = int(payload["epoch"]), int(payload["tokens_total"])
        self.state.merged = dict(payload["merged"])
        self.layout.scatter(payload["theta"], self.trainer.params)
        self.trainer.optimizer.load_state_dict(payload["optimizer"])
        self.trainer.local_steps = int(payload["local_steps"])
        self.pending_tokens, self.pending_rounds = int(payload["pending_tokens"]), int(payload["pending_rounds"])
        self.rounds, self.last_loss = int(payload["rounds"]), payload.get("last_loss")
        eval_loss = self.trainer.evaluate(self.eval_batches)  # the level we resume at, on the held-out split
        partial = int(payload.get("round_steps", 0))
        self.reporter.info(f"resumed from {self.node.checkpoint_dir}: epoch {self.state.epoch}, "
                           f"loss {self.last_loss if self.last_loss is None else round(self.last_loss, 3)}, "
                           f"held-out eval {eval_loss:.6f}"
                           + (f", {partial} steps into a round ({self.pending_tokens} tokens of work unmerged)"
                              if partial else ""))
        return int(payload["data_position"])

    def _announce(self, num_params: int, device: torch.device) -> None:
        run = self.run
        self.reporter.info(
            f"peer {self.peer_id} | run '{self.node.run_id}' ({self.manifest.hash}) | {run.model}: "
            f"{num_params / 1e6:.1f}M parameters on {device} | H={run.inner_steps} | {run.compression}"
        )
        self.reporter.info(f"run key (joiners may pin the run's creator with --run-key): {self.manifest.creator}")
        if not self.net.client_mode:
            self.reporter.info("others join this run with --initial-peers and one of:")
            for maddr in visible_maddrs(self.dht):
                print(f"  {maddr}", flush=True)

    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            if self.stop_requested.is_set():
                os._exit(130)  # a second Ctrl+C: quit now (children die with us)
            self.stop_requested.set()
            self.reporter.info(f"{signal.Signals(signum).name}: leaving after the current step "
                               f"(checkpoint, then exit); press Ctrl+C again to quit at once")

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, handler)

    def _share_state(self):
        """(metadata, [G, m]) for a peer downloading our state: a consistent snapshot under the lock."""
        with self.lock:
            return self.state.metadata(), [self.state.params.clone(), self.state.momentum.clone()]

    # ------------------------------------------------------------------ run
    def run_rounds(self) -> int:
        """Round after round until stopped. Without overlap, each round's sync runs between two inner phases;
        with ``--overlap`` it runs in the background during the next inner phase, and is joined (reported,
        checkpointed) at that phase's end, before the next sync starts."""
        max_rounds, run, clock = self.node.max_rounds, self.run, self.clock
        batches = island_batches(self.stream, run.batch_size, self.island)
        inflight: Optional[InFlight] = None
        clock.sync_in_flight = lambda: inflight is not None and not inflight.done.is_set()
        while not self.stop_requested.is_set() and not (max_rounds and self.rounds + bool(inflight) >= max_rounds):
            round_start = time.monotonic()
            steps = clock.begin()
            epoch_at_start = self.state.epoch
            self.reporter.start_round(self.state.epoch, steps if steps < 10**9 else 0)

            def on_step(step: int, loss: float, lr: float) -> None:
                elapsed, tokens = time.monotonic() - round_start, step * run.batch_size * run.seq_len
                self.reporter.step(step, loss, tokens / max(elapsed, 1e-9))
                clock.watch()
                if inflight is None and self._checkpoint_due():  # the round so far, should this process die
                    self._checkpoint(round_tokens=tokens, round_steps=step)
                if step == max(1, min(steps, run.inner_steps) // 2):
                    self.hooks.at(INNER, epoch_at_start)

            def should_stop(steps_done: int) -> bool:
                return self.stop_requested.is_set() or clock.over(steps_done)

            stats = self.trainer.train(batches, steps, self._global_step(), should_stop, on_step)
            if self.island is not None:  # the island's weight: the tokens of all its ranks
                stats.rank_tokens = self.island.end_round(stats.tokens)
                stats.tokens = sum(stats.rank_tokens)
            self.reporter.end_round()
            self.pending_tokens += stats.tokens
            if stats.steps == 0 or self.stop_requested.is_set():
                break
            self.pending_rounds += 1
            if inflight is not None:
                self._finish(inflight)
            inflight = self._launch(stats)
            if not self.node.overlap:
                self._finish(inflight)
                inflight = None
        if inflight is not None:  # stopping (or the last round): the sync in flight completes first
            self.clock.planned.set()  # no next round to plan
            self._finish(inflight)
        self._publish(status=LEAVING)  # nobody counts us in a group now; we still serve our state
        stranded = self.synchronizer.hand_over()
        if stranded:
            logger.info(f"leaving while {len(stranded)} peer(s) that lack our state could get it from nobody else")
        return 0

    def _launch(self, stats) -> "InFlight":
        """Start this round's sync: in the background with overlap (on theta frozen now), else right here."""
        self.pending_tokens += self.synchronizer.take_recovered_tokens()
        step_seconds = self.clock.step_seconds or stats.compute_seconds / stats.steps
        job = InFlight(stats, self.pending_tokens, self.pending_rounds)
        budget = job.budget = self.synchronizer.round_budget()

        def sync() -> SyncResult:
            if self.node.overlap:  # the next round's plan first: this sync shares it with the group
                self.clock.planned.wait(timeout=10.0)
            result = self.synchronizer.sync(job.tokens, budget, missed_rounds=job.rounds - 1,
                                            step_seconds=step_seconds)
            if self.node.overlap and not result.applied:
                # the round in progress was planned before this sync caught up (or found no group): line its
                # end up with the swarm's, or we reach the next sync out of step with everyone again
                self.clock.realign()
            elif self.node.overlap and result.round_end is not None:
                self.clock.retarget(result.round_end)  # the group ends the round in progress together
            return result

        if self.node.overlap:
            self.local.freeze(with_moments=self.moment is not None)
            self.local.start(self.synchronizer.eager_target())
            self.clock.planned.clear()
        job.start(sync, background=self.node.overlap)
        return job

    def _finish(self, job: "InFlight") -> None:
        """Join a round's sync; account its tokens, report it, checkpoint."""
        run, wait_start = self.run, time.monotonic()
        result = job.wait()
        self.local.thaw()
        sync_seconds = time.monotonic() - (wait_start if self.node.overlap else job.started)
        self.clock.finish(job.stats.steps, job.stats.compute_seconds, result.next_round_seconds,
                          anchor=result.round_end if self.node.overlap else None)
        stale = job.rounds - 1
        self._drop_resumed_if_merged()
        if result.applied:
            self.pending_tokens -= job.tokens
            self.pending_rounds -= job.rounds
        elif self.pending_rounds > run.max_staleness:
            self.reporter.info(f"{self.pending_rounds} rounds of work went unmerged, past --max-staleness "
                               f"{run.max_staleness}: dropping them and resyncing to the global state")
            self.synchronizer.drop_unmerged()
            self.pending_tokens = self.pending_rounds = 0
        self.rounds += 1
        self.last_loss = job.stats.loss
        self.last_round_seconds = job.stats.compute_seconds + sync_seconds
        eval_loss = None
        if result.applied and self.state.epoch % run.eval_every == 0:
            eval_loss = self._evaluate_global()
        result.rebased = result.rebased or self.clock.rebased
        # every rank of an island holds the same parameters: they are hashed to show it
        island_hashes = self.island.check(self.trainer) if self.island is not None else None
        traffic = self._round_traffic()
        self.last_bytes_sent = traffic[0] or self.last_bytes_sent
        record = self._metrics(job.stats, result, sync_seconds, stale, eval_loss, traffic)
        record.update(overlap=self.node.overlap, sync_wall_seconds=job.finished - job.started, sync_deadline=job.budget)
        if self.island is not None:
            record.update(island_ranks=self.island.size, island_tokens=job.stats.rank_tokens,
                          island_hashes=island_hashes)
        self.reporter.round(record)
        self._checkpoint()

    def _evaluate_global(self) -> float:
        """Held-out loss of the global parameters G. With overlap the model holds G plus the next round's
        steps, so G is swapped in for the evaluation and the model restored after."""
        if not self.node.overlap:
            return self.trainer.evaluate(self.eval_batches)  # theta == G right after the outer step
        theta = self.layout.gather(self.trainer.params, self.layout.empty())
        self.layout.scatter(self.state.params, self.trainer.params)
        try:
            return self.trainer.evaluate(self.eval_batches)
        finally:
            self.layout.scatter(theta, self.trainer.params)

    def _round_traffic(self):
        """Bytes this peer's averager moved through the transport since the last round ended."""
        sent, received = self.averager.traffic()
        traffic = (sent - self.traffic_seen[0], received - self.traffic_seen[1])
        self.traffic_seen = (sent, received)
        return traffic

    def _global_step(self) -> int:
        return self.state.epoch * self.run.inner_steps

    def _metrics(self, stats, result: SyncResult, sync_seconds: float, stale: int, eval_loss,
                 traffic) -> Dict[str, Any]:
        return dict(
            epoch=self.state.epoch, time=time.time(), peer_id=self.peer_id, round=self.rounds, loss=stats.loss,
            eval_loss=eval_loss, tokens=stats.tokens, tokens_total=self.state.tokens_total,
            inner_steps=stats.steps, group_size=len(result.group), group=list(result.group),
            state_hash=self.state.hash(), bytes_sent=traffic[0], bytes_received=traffic[1],
            compute_seconds=stats.compute_seconds, sync_seconds=sync_seconds, stale=stale,
            rebased=result.rebased, applied=result.applied, attempts=result.attempts, aligned=result.aligned,
            lr=stats.lr, tokens_per_second=stats.tokens / max(stats.compute_seconds, 1e-9), error=result.error,
            offences=result.offences, peak_memory_bytes=self.trainer.peak_memory(), device=str(self.trainer.device),
        )

    # ------------------------------------------------------------------ publish, checkpoint, close
    def _pace(self) -> Optional[float]:
        return self.clock.step_seconds if self.clock is not None else None

    def _ranks(self) -> int:
        return self.island.size if self.island is not None else 1

    def _record_ttl(self) -> float:
        """How long our record outlives its last refresh. The heartbeat thread refreshes it every 2 s, and others
        stop waiting for a dead peer once its heartbeats stop (``consensus.responsive``); this only bounds how
        long a dead peer's record stays in the DHT, its state counted by the fork choice."""
        step = self._pace() or 0.0
        return max(RECORD_TTL, 4 * step, self.run.grace_seconds + self.sync_config.allreduce_timeout + 10)

    def _publish(self, status: str = "training", next_sync_at: Optional[float] = None) -> None:
        self.synchronizer.announce(
            self._record_ttl(), status=status, loss=self.last_loss, next_sync_at=next_sync_at,
            round_seconds=self.last_round_seconds, bytes_per_round=self.last_bytes_sent,
            tokens_per_second=self.run.batch_size * self.run.seq_len * self._ranks() / self._pace() if self._pace()
            else 0.0,
        )
        if time.monotonic() - self.manifest_published_at > MANIFEST_TTL / 4:
            publish_manifest(self.dht, self.manifest)
            self.manifest_published_at = time.monotonic()

    def _drop_resumed_if_merged(self) -> None:
        """The swarm's state holds the work we resumed from our checkpoint (we died after our group merged it,
        before the round's checkpoint): it is not ours to send again (``Synchronizer.adopt``)."""
        if self.synchronizer.take_dropped_resumed():
            self.reporter.info(f"the swarm merged the work this peer resumed from its checkpoint before the peer "
                               f"stopped (epoch {self.state.epoch}'s state holds it): not sent again; dropping its "
                               f"{self.pending_tokens:,} tokens of unmerged work (that round's, and any trained on "
                               f"it since)")
            self.pending_tokens = self.pending_rounds = 0

    def _checkpoint_due(self) -> bool:
        """Mid-round checkpoints: not with overlap (the sync in flight changes the state under the round), nor
        on an island (rank 0 would save its ranks' tokens without them)."""
        every = self.node.checkpoint_every
        return bool(self.node.checkpoint_dir and every and not self.node.overlap and self.island is None
                    and time.monotonic() - self.checkpointed_at >= every)

    def _checkpoint(self, round_tokens: int = 0, round_steps: int = 0) -> None:
        """Save everything a restart resumes from. Mid-round, ``round_tokens`` trained in ``round_steps`` steps
        of the round in progress: they are in theta, and count in the contribution that the restart sends."""
        if not self.node.checkpoint_dir:
            return
        self.checkpointed_at = time.monotonic()
        with self.lock:
            payload = dict(
                manifest_settings=dict(self.manifest.settings), manifest_hash=self.manifest.hash,
                manifest_record=self.manifest.to_record(),
                run_id=self.node.run_id, peer_id=self.peer_id, params=self.state.params,
                momentum=self.state.momentum, epoch=self.state.epoch, tokens_total=self.state.tokens_total,
                merged=dict(self.state.merged), theta=self.layout.gather(self.trainer.params, self.layout.empty()),
                optimizer=self.trainer.optimizer.state_dict(), local_steps=self.trainer.local_steps,
                data_position=self.stream.position, pending_tokens=self.pending_tokens + round_tokens,
                round_steps=round_steps, pending_rounds=self.pending_rounds, rounds=self.rounds,
                last_loss=self.last_loss,
                residual=self.feedback.residual, carried=self.synchronizer.carried,
                recovered_tokens=self.synchronizer.recovered_tokens,
            )
            epoch = self.state.epoch
            strike = None if round_steps else (lambda: self.hooks.at(CHECKPOINT, epoch))  # a round's checkpoint
            save_checkpoint(self.node.checkpoint_dir, payload, before_rename=strike)

    def close(self) -> None:
        """Checkpoint, tell the swarm we left, and stop our processes; safe to call on any path."""
        if self.synchronizer is not None:
            self._checkpoint()
            self.synchronizer.publisher.stop()
            try:
                self._publish(status="left")
            except Exception as e:  # the p2p daemon may already be gone (Ctrl+C reaches it too)
                logger.debug(f"could not publish our departure: {e!r}")
        self.reporter.close()
        if self.island is not None:
            self.island.close()
        for component in (self.averager, self.dht):
            if component is not None and component.is_alive():
                component.shutdown()


class InFlight:
    """One round's sync, run here or on a background thread (overlap), with what it was started with."""

    def __init__(self, stats, tokens: int, rounds: int):
        self.stats, self.tokens, self.rounds = stats, tokens, rounds
        self.started = self.finished = time.monotonic()
        self.budget = 0.0  # the longest the sync may block, retries included (``Synchronizer.round_budget``)
        self.done = threading.Event()
        self.result: Optional[SyncResult] = None
        self.error: Optional[BaseException] = None

    def start(self, sync, background: bool) -> None:
        def run():
            try:
                self.result = sync()
            except BaseException as e:  # re-raised in the training thread by wait()
                self.error = e
            finally:
                self.finished = time.monotonic()
                self.done.set()

        if background:
            threading.Thread(target=run, name="sync", daemon=True).start()
        else:
            run()

    def wait(self) -> SyncResult:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result
