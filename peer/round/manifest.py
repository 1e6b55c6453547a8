"""Which run this node joins: the manifest it proposes (its checkpoint's, or one from its flags), the swarm's
answer, and a one-line refusal where they disagree (a flag, a config file's value, or a checkpoint of another
configuration of the run).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dht.errors import UserError
from dht.manifest import RunManifest, join_or_create, listed_name, publish_manifest
from dht.node import DHTConfig
from peer import config_file
from peer.config import NodeConfig, RunConfig
from peer.ops.checkpoint import CheckpointPayload
from peer.train.source import copies_of, pinned


def propose_manifest(namespace: str, run_flags: Dict[str, Any], node: NodeConfig,
                     payload: Optional[CheckpointPayload]) -> RunManifest:
    """The manifest we would start the run with: the checkpoint's, or one from the flags."""
    if payload is None:
        return RunManifest(namespace, pinned(RunConfig(**run_flags)).to_settings())
    proposal = RunManifest.from_record(namespace, payload.manifest_record)
    if proposal is None:
        raise UserError(f"checkpoint in {node.checkpoint_dir} holds no valid signed run manifest (an "
                        f"older format?); use another --checkpoint-dir")
    return proposal


def resolve_manifest(dht, namespace: str, run_flags: Dict[str, Any], node: NodeConfig, net: DHTConfig,
                     payload: Optional[CheckpointPayload], proposal: RunManifest) -> Tuple[RunManifest, bool]:
    """The run's manifest: the swarm's if it has one, else ours (``proposal``: from the checkpoint or the flags); and
    whether we created the run."""
    run_id = node.run_id
    listed = listed_name(run_id, namespace)
    if net.initial_peers:
        # a checkpoint proves the run existed: its peer may bring it back when the swarm has lost it
        manifest, created = join_or_create(dht, proposal, node.run_key, create=node.new_run or payload is not None,
                                           name=run_id, listed=listed is not None)
    else:
        manifest, created = (proposal if proposal.verified() else proposal.signed()), True
        if node.run_key is not None and manifest.creator != node.run_key.strip():
            raise UserError("--run-key names another creator, but this peer starts the run itself (no "
                            "--initial-peers): drop --run-key, or pass the run's --initial-peers")
        publish_manifest(dht, manifest, listed_as=listed)
    # flags that say where this node keeps the run's model or tokenizer are checked against the pins by
    # ``localized``, not compared as text
    copies = copies_of(manifest.settings, run_flags)
    for name, value in run_flags.items():
        if name not in copies and manifest.settings.get(name) != value:
            filed = node.config is not None and config_file.from_file(node.config, name, value)
            given, drop = (f"{name} = {value!r} in {node.config}", "drop it from the file") if filed else \
                (f"--{name.replace('_', '-')} {value}", "drop the flag")
            raise UserError(
                f"{given} conflicts with run '{run_id}', which uses {name}={manifest.settings.get(name)}; "
                f"{drop} to join it, or pass another --run-id to start a new run"
            )
    if payload is not None and payload.manifest_hash != manifest.hash:
        raise UserError(
            f"checkpoint in {node.checkpoint_dir} belongs to another configuration of run '{run_id}' "
            f"(manifest {payload.manifest_hash}, the swarm's is {manifest.hash}); use another --checkpoint-dir"
        )
    return manifest, created
