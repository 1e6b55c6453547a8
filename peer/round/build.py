"""Build a node's parts from its configs, each with its collaborators passed in: the order a peer starts in.

1. the checkpoint, if any (a corrupt file fails here, before any network), and a stable identity;
2. the DHT's process, forked; while its p2p daemon starts, the trainer and the global state (restored from the
   checkpoint) of a run known already: a checkpoint's, or one this peer starts alone (docs/design.md, "Startup");
3. the run's manifest: the swarm's, or ours from the checkpoint or the flags; a joiner's trainer, built now;
4. error feedback and the averager process (forked: it inherits the warmed-up codec);
5. the round's parts: transport, record cache, announcer, lineage, catch-up, synchronizer.

``Parts.close`` shuts down what was started, on every path; a failure half-way closes what was started so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from diloco_compression import Codec, get_codec
from diloco_compression.feedback import ErrorFeedback, roundtrip

from dht.addresses import parse_maddrs
from dht.joining import reachable
from dht.manifest import RunManifest, run_namespace
from dht.node import DHTConfig, dht_ready, discard_made_up_identity, signing_identity, start_dht
from dht.processes import stop_process
from dht.reach import Reach
from dht.validation import run_validators
from peer.averaging.averager import SwarmAverager
from peer.config import NodeConfig, RunConfig, SyncConfig
from peer.hooks import Hooks
from peer.ops.checkpoint import CheckpointPayload
from peer.ops.dashboard import Dashboard
from peer.ops.report import Reporter
from peer.ops.status import snapshot
from peer.ops.trackers import Trackers
from peer.outer.contributions import Contributions
from peer.outer.fragments import Fragments
from peer.outer.lineage import Lineage
from peer.outer.state import GlobalState
from peer.round.announce import Announcer, Identity
from peer.round.catchup import StateCatchUp
from peer.round.manifest import propose_manifest, resolve_manifest
from peer.round.sync import Synchronizer
from peer.round.transport import SwarmTransport
from peer.swarm.clock import Clock
from peer.swarm.deadlines import Deadlines
from peer.swarm.records import RecordCache
from peer.train.build import build_trainer
from peer.train.flat import FlatLayout
from peer.train.island import Island
from peer.train.local import LocalModel
from peer.train.source import keep_tokenizer, localized


@dataclass
class Progress:
    """This peer's own count of its work, saved in its checkpoints."""

    rounds: int = 0  # rounds this peer finished
    pending_tokens: int = 0  # tokens of its work not merged yet
    pending_rounds: int = 0  # rounds of that work
    last_loss: Optional[float] = None


@dataclass
class Parts:
    namespace: str  # the name of the run's DHT and matchmaking keys: secret for a private run (--run-token)
    reporter: Reporter
    dht: Any
    peer_id: str
    net: DHTConfig  # as it runs: in client mode if nobody could dial it (--if-unreachable)
    reach: Reach
    manifest: RunManifest
    created: bool  # we started the run (no manifest in the swarm before ours)
    run: RunConfig
    trainer: Any
    eval_batches: Any
    layout: FlatLayout
    state: GlobalState
    stream: Any
    progress: Progress
    feedback: ErrorFeedback
    averager: SwarmAverager
    transport: SwarmTransport
    cache: RecordCache
    announcer: Announcer
    lineage: Lineage
    local: LocalModel
    catchup: StateCatchUp
    synchronizer: Synchronizer
    lock: threading.Lock  # guards the global state against a concurrent download by a peer
    closer: contextlib.ExitStack
    resumed_hash: Optional[str] = None  # hash(G, m, e) as restored from the checkpoint; None on a fresh start

    def close(self) -> None:
        self.closer.close()


def build_parts(run_flags: Dict[str, Any], node: NodeConfig, sync: SyncConfig, net: DHTConfig,
                island: Optional[Island], hooks: Hooks) -> Parts:
    if node.threads:
        torch.set_num_threads(node.threads)
    with contextlib.ExitStack() as closer:
        reporter = Reporter(node.metrics_file, node.quiet)
        closer.callback(reporter.close)
        payload, net = _checkpoint_and_identity(node, net)
        net, fresh = signing_identity(net)  # our records are signed with our peer id's own key
        namespace = run_namespace(node.run_id, node.run_token or os.environ.get("DILOCO_RUN_TOKEN"))
        validators = run_validators(namespace)
        proposal = propose_manifest(namespace, run_flags, node, payload)
        # the DHT's process starts its p2p daemon and reaches the initial peers while this one builds the model
        # (forked here, before any model work: this process runs no other thread yet)
        dht = start_dht(net, validators, check_identity=not fresh, await_ready=False)
        closer.callback(stop_process, dht)
        # a run that is ours (a checkpoint's, or one we start alone) is known before the swarm answers; a joiner's
        # comes from the swarm. A manifest the swarm then refuses ends in resolve_manifest's one line, nothing written
        early = island is None and (payload is not None or not net.initial_peers)
        local = _local_side(_as_here(proposal.settings, run_flags), node, None, payload) if early else None
        dht = dht_ready(dht, net)
        peer_id = dht.peer_id.to_base58()
        manifest, created = resolve_manifest(dht, namespace, run_flags, node, net, payload, proposal)  # the right run
        dht, net, reach = _reachable(dht, net, validators, closer)
        discard_made_up_identity(net)  # our DHT node runs for good now
        run = _as_here(manifest.settings, run_flags)  # this node's model copies
        if node.checkpoint_dir:
            keep_tokenizer(run, node.checkpoint_dir)
        reporter.trackers = Trackers.from_flags(node.tensorboard, node.wandb, run_id=node.run_id, peer_id=peer_id,
                                                config=dict(manifest.settings, peer_id=peer_id))
        if node.dashboard:
            _serve_dashboard(node, dht, namespace, closer, reporter)
        local = _local_for(run, local, node, island, payload, peer_id)
        if payload is not None:
            _say_resumed(payload, local.progress, node, reporter)
        stream = local.corpus.stream(run.seed, peer_id, local.position)
        if island is not None:
            island.share(local.position)
        trainer, layout, state, progress = local.trainer, local.layout, local.state, local.progress
        parts = Parts(namespace=namespace, reporter=reporter, dht=dht, peer_id=peer_id, net=net, reach=reach,
                      manifest=manifest, created=created, run=run, trainer=trainer,
                      eval_batches=local.corpus.eval_batches(run.eval_batches, run.batch_size),
                      layout=layout, state=state, stream=stream, progress=progress,
                      resumed_hash=state.hash() if payload is not None else None,  # join publishes it: computed once
                      **_round_parts(run, sync, net, reach, hooks, dht, namespace, manifest, peer_id, trainer, layout,
                                     state, payload, progress, closer))
        parts.closer = closer.pop_all()  # from here on, Parts.close shuts everything down
        return parts


@dataclass
class LocalSide:
    """What a peer trains, built without the network: the corpus, the trainer, G and m, restored if resuming."""

    run: RunConfig
    corpus: Any
    trainer: Any
    layout: FlatLayout
    state: GlobalState
    progress: Progress
    position: int  # where this peer's data order stands


def _local_side(run: RunConfig, node: NodeConfig, island: Optional[Island],
                payload: Optional[CheckpointPayload]) -> LocalSide:
    corpus, trainer = build_trainer(run, node, island)
    layout = FlatLayout(trainer.params)
    state = GlobalState(params=layout.gather(trainer.params, layout.empty()), momentum=layout.empty())
    progress, position = Progress(), 0
    if payload is not None:
        progress, position = restore(payload, state, trainer, layout)
    return LocalSide(run, corpus, trainer, layout, state, progress, position)


def _local_for(run: RunConfig, early: Optional[LocalSide], node: NodeConfig, island: Optional[Island],
               payload: Optional[CheckpointPayload], peer_id: str) -> LocalSide:
    """The local side of the run the swarm agreed on: the one built before the swarm answered if it is that run's,
    else one built now."""
    if early is not None and early.run == run:
        return early
    if island is not None:  # the other ranks build the same trainer from the same settings
        island.share(dict(settings=dataclasses.asdict(run), shard_key=peer_id))
    return _local_side(run, node, island, payload)


def _reachable(dht, net: DHTConfig, validators, closer: contextlib.ExitStack) -> Tuple[Any, DHTConfig, Reach]:
    """Our DHT as the swarm reaches it: relayed, or in client mode, it is a new one (the first is shut down)."""
    restarted, net, reach = reachable(dht, net, validators)
    if restarted is not dht:
        closer.callback(stop_process, restarted)
    return restarted, net, reach


def _as_here(settings, run_flags: Dict[str, Any]) -> RunConfig:
    """A manifest's run as this node loads it: its own copies of a Hugging Face model and tokenizer."""
    return localized(RunConfig.from_settings(dict(settings)), run_flags)


def _round_parts(run: RunConfig, sync: SyncConfig, net: DHTConfig, reach: Reach, hooks: Hooks, dht, namespace: str,
                 manifest: RunManifest, peer_id: str, trainer, layout: FlatLayout, state: GlobalState,
                 payload: Optional[CheckpointPayload], progress: Progress, closer: contextlib.ExitStack) -> dict:
    """Error feedback, the averager process, and the round's parts, each given its collaborators."""
    lock = threading.Lock()
    codec = get_codec(run.compression)
    # encode once now: the first use imports bitsandbytes and self-checks its decoder (seconds on a busy machine),
    # which inside the first all-reduce would run past the part deadline; the averager process, forked below,
    # inherits the warm codec
    roundtrip(codec, torch.zeros(1 << 12))
    feedback = ErrorFeedback(codec, layout.numel, enabled=run.error_feedback)
    if payload is not None and feedback.residual is not None and payload.residual is not None:
        feedback.residual.copy_(payload.residual)

    def share_state():
        """(metadata, [G, m]) for a peer downloading our state: a consistent snapshot under the lock."""
        with lock:
            return state.metadata(), [state.params.clone(), state.momentum.clone()]

    averager, ceiling = _start_averager(run, sync, net, hooks, dht, f"{namespace}_{manifest.hash}", codec,
                                        layout.numel, share_state, closer)
    transport = SwarmTransport(dht, averager, namespace, run.grace_seconds)
    closer.callback(transport.stop)
    clock, cache, local = Clock(), RecordCache(peer_id), LocalModel(trainer, layout)
    announcer = Announcer(transport, Identity(peer_id, manifest.hash, net.client_mode, reach.value), state)
    lineage = Lineage(Contributions(codec, run.max_staleness),
                      carried=payload.carried if payload is not None else None,
                      recovered_tokens=payload.recovered_tokens if payload is not None else 0,
                      # unmerged work, trained on G at this epoch: our group may have merged it since
                      resumed_epoch=state.epoch if progress.pending_tokens else None)
    deadlines = Deadlines(ceiling=ceiling, floor=sync.deadline_floor, factor=sync.deadline_factor,
                          part_ceiling=sync.part_timeout)
    catchup = StateCatchUp(transport=transport, clock=clock, cache=cache, announcer=announcer, state=state,
                           local=local, layout=layout, lineage=lineage, feedback=feedback, lock=lock,
                           deadlines=deadlines, run=run, sync=sync)
    initial = tuple(m["p2p"] for m in parse_maddrs(net.initial_peers, flag="--initial-peers", need_peer_id=True))
    synchronizer = Synchronizer(transport=transport, clock=clock, cache=cache, announcer=announcer, catchup=catchup,
                                state=state, local=local, layout=layout, lineage=lineage, feedback=feedback,
                                lock=lock, deadlines=deadlines, run=run, sync=sync, has_moment=bool(run.align_every),
                                hooks=hooks, initial_peer_ids=initial)
    return dict(feedback=feedback, averager=averager, transport=transport, cache=cache, announcer=announcer,
                lineage=lineage, local=local, catchup=catchup, synchronizer=synchronizer, lock=lock, closer=closer)


def _start_averager(run: RunConfig, sync: SyncConfig, net: DHTConfig, hooks: Hooks, dht, prefix: str, codec: Codec,
                    numel: int, share_state: Callable, closer: contextlib.ExitStack) -> Tuple[SwarmAverager, float]:
    """The averager process, on buffers of one round's fragment; and the longest its all-reduce may take."""
    # a round averages one fragment of the flat vector (the whole of it without --fragments)
    size = Fragments(numel, run.fragments).size
    # what a member sends in a round's all-reduce, at most: 2 (n - 1) / n of the payload, and the first moment too
    ceiling = sync.allreduce_ceiling(2 * (1 + bool(run.align_every)) * codec.wire_bytes(size))
    delta = torch.zeros(size).share_memory_()
    moment = torch.zeros(size).share_memory_() if run.align_every else None
    averager = SwarmAverager(
        delta, moment, dht, prefix=prefix, codec=codec, state_provider=share_state,
        quorum=run.quorum, grace_seconds=run.grace_seconds, request_timeout=sync.request_timeout,
        allreduce_timeout=ceiling, part_timeout=sync.part_timeout, client_mode=net.client_mode,
        hooks=hooks, clip_factor=run.clip_factor, ban_after=run.ban_after, state_size=numel,
        max_upload_mbit=sync.max_upload,
    )
    averager.run_in_background(await_ready=True)
    closer.callback(stop_process, averager)
    return averager, ceiling


def _checkpoint_and_identity(node: NodeConfig, net: DHTConfig):
    """The checkpoint to resume from (None for a fresh peer), and the identity file it keeps the peer id with."""
    if not node.checkpoint_dir:
        return None, net
    os.makedirs(node.checkpoint_dir, exist_ok=True)
    payload = CheckpointPayload.load(node.checkpoint_dir)  # a corrupt file fails here, before any network
    if net.identity_path is None:
        net = dataclasses.replace(net, identity_path=os.path.join(node.checkpoint_dir, "identity.key"))
    return payload, net


def _serve_dashboard(node: NodeConfig, dht, namespace: str, closer: contextlib.ExitStack, reporter: Reporter) -> None:
    """--dashboard: this peer serves its own view of the swarm, read through its DHT node like any observer's."""
    dashboard = Dashboard(lambda: snapshot(dht, node.run_id, namespace), node.dashboard, node.dashboard_host).start()
    closer.callback(dashboard.stop)
    reporter.info(f"the swarm's dashboard: {dashboard.url}")


def restore(payload: CheckpointPayload, state: GlobalState, trainer, layout: FlatLayout) -> Tuple[Progress, int]:
    """Resume epoch, outer state, inner model and optimizer from a checkpoint; returns (progress, data position).
    Nothing is evaluated here: a restart's first inner step waits for nothing but the model (the state's hash, in the
    first round's metrics as ``resumed_hash``, says bit for bit what was restored)."""
    state.params.copy_(payload.params)
    state.momentum.copy_(payload.momentum)
    state.epoch, state.tokens_total, state.merged = int(payload.epoch), int(payload.tokens_total), dict(payload.merged)
    layout.scatter(payload.theta, trainer.params)
    trainer.optimizer.load_state_dict(payload.optimizer)
    trainer.local_steps = int(payload.local_steps)
    progress = Progress(int(payload.rounds), int(payload.pending_tokens), int(payload.pending_rounds),
                        payload.last_loss)
    return progress, int(payload.data_position)


def _say_resumed(payload: CheckpointPayload, progress: Progress, node: NodeConfig, reporter: Reporter) -> None:
    loss, partial = progress.last_loss, int(payload.round_steps)
    reporter.info(f"resumed from {node.checkpoint_dir}: epoch {int(payload.epoch)}, "
                  f"loss {loss if loss is None else round(loss, 3)}"
                  + (f", {partial} steps into a round ({progress.pending_tokens} tokens of work unmerged)"
                     if partial else ""))
