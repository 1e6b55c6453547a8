"""The run manifest: the settings every peer of a run must share, published once and read by joiners.

A joiner needs nothing but ``--initial-peers``: it reads the manifest and builds the same model, data
and hyperparameters. The hash covers the settings and the protocol version, so two runs that differ
in anything that matters never average together.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import hivemind
from hivemind.utils import get_dht_time

PROTOCOL_VERSION = "ddl/1"
MANIFEST_TTL = 3600.0  # seconds; every live peer re-publishes it each round, so it outlives no run by much


def manifest_key(run_id: str) -> str:
    return f"{run_id}_manifest"


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    settings: Mapping[str, Any] = field(default_factory=dict)  # JSON-able run-level settings
    version: str = PROTOCOL_VERSION

    @property
    def hash(self) -> str:
        canonical = json.dumps(
            dict(run_id=self.run_id, settings=dict(self.settings), version=self.version), sort_keys=True
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def to_record(self) -> Dict[str, Any]:
        return dict(settings=dict(self.settings), version=self.version, hash=self.hash)

    @classmethod
    def from_record(cls, run_id: str, record: Any) -> Optional["RunManifest"]:
        """Parse a stored record (JSON text, as published, or its dict); ``None`` if it is malformed or its
        hash does not match its contents."""
        if isinstance(record, str):
            try:
                record = json.loads(record)
            except ValueError:
                return None
        if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
            return None
        manifest = cls(run_id, dict(record["settings"]), str(record.get("version", "")))
        return manifest if manifest.hash == record.get("hash") else None


def publish_manifest(dht: hivemind.DHT, manifest: RunManifest, ttl: float = MANIFEST_TTL) -> bool:
    # JSON text: hivemind's schema validation takes no plain dict as a regular value (dht/validation.py)
    text = json.dumps(manifest.to_record(), sort_keys=True)
    return bool(dht.store(manifest_key(manifest.run_id), text, get_dht_time() + ttl))


def fetch_manifest(dht: hivemind.DHT, run_id: str) -> Optional[RunManifest]:
    found = dht.get(manifest_key(run_id), latest=True)
    return None if found is None else RunManifest.from_record(run_id, found.value)


def join_or_create(dht: hivemind.DHT, proposal: RunManifest) -> RunManifest:
    """Adopt the run's manifest if one exists; otherwise publish ``proposal``.

    Two peers that create the same run at once both publish and then both read back the DHT's single
    winner (the record with the latest expiration), so they still agree on one manifest.
    """
    existing = fetch_manifest(dht, proposal.run_id)
    if existing is not None:
        return existing
    publish_manifest(dht, proposal)
    return fetch_manifest(dht, proposal.run_id) or proposal
