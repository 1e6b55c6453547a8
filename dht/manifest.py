"""The run manifest: the settings every peer of a run must share, signed by the run's creator.

A joiner needs nothing but ``--initial-peers``: it reads the manifest and builds the same model, data
and hyperparameters. The hash covers the run id, the settings and the protocol version, so two runs
that differ in anything that matters never average together; two peers that create the same run at
once, with the same settings, sign the same hash and train together.

Integrity: the creator signs the hash with its RSA key; the signature travels in the manifest, so any
peer can re-publish it unchanged, and a reader drops a manifest whose signature or hash does not check.
Each creator's manifest lives under its own subkey (the key's fingerprint), so a stranger who publishes
another manifest under the same run id cannot replace the real one: a joiner that pins the creator
with ``--run-key`` takes only that creator's; otherwise it takes the manifest most live peers train
with (their records name its hash), and the lowest hash between equals.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from dht.errors import UserError

PROTOCOL_VERSION = "ddl/1"
MANIFEST_TTL = 3600.0  # seconds; every live peer re-publishes it each round, so it outlives no run by much
RUNS_KEY = "diloco_runs"  # the public runs' names, one subkey each: what a joiner who named no such run is shown
LOOK_SECONDS = 5.0  # how long a joiner looks for its run's manifest before it says there is none


def manifest_key(run_id: str) -> str:
    return f"{run_id}_manifest"


def run_namespace(run_id: str, token: Optional[str]) -> str:
    """The name a run's DHT keys and matchmaking keys are built from. A private run's depends on its shared
    token, so a stranger without it can neither find the run's manifest and records nor address its groups."""
    if not token:
        return run_id
    return f"{run_id}-{hmac.new(token.encode(), run_id.encode(), hashlib.sha256).hexdigest()[:24]}"


def listed_name(run_id: str, namespace: str) -> Optional[str]:
    """The name a run is listed under in ``RUNS_KEY``: its own for a public run, none for a private one (whose
    namespace, derived from its token, differs from its name: its keys are secret)."""
    return run_id if namespace == run_id else None


def own_run_key() -> str:
    """This process's public key, as a creator names itself in a manifest and a joiner pins it."""
    return RSAPrivateKey.process_wide().get_public_key().to_bytes().decode()


def fingerprint(run_key: str) -> str:
    return hashlib.sha256(run_key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    settings: Mapping[str, Any] = field(default_factory=dict)  # JSON-able run-level settings
    version: str = PROTOCOL_VERSION
    creator: str = ""  # the creator's public key (ssh-rsa ...)
    signature: str = ""  # the creator's signature of the hash (base64)

    @property
    def hash(self) -> str:
        canonical = json.dumps(dict(run_id=self.run_id, settings=dict(self.settings), version=self.version),
                               sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def signed(self, key: Optional[RSAPrivateKey] = None) -> "RunManifest":
        """This manifest created and signed by ``key`` (by default this process's)."""
        key = key or RSAPrivateKey.process_wide()
        creator = key.get_public_key().to_bytes().decode()
        return replace(self, creator=creator, signature=key.sign(self._signed_bytes(creator)).decode())

    def _signed_bytes(self, creator: str) -> bytes:
        return f"{self.hash}|{creator}".encode()

    def verified(self) -> bool:
        if not self.creator or not self.signature:
            return False
        try:
            return RSAPublicKey.from_bytes(self.creator.encode()).verify(self._signed_bytes(self.creator),
                                                                         self.signature.encode())
        except (ValueError, TypeError):
            return False

    def to_record(self) -> Dict[str, Any]:
        return dict(settings=dict(self.settings), version=self.version, hash=self.hash, creator=self.creator,
                    signature=self.signature)

    @classmethod
    def from_record(cls, run_id: str, record: Any) -> Optional["RunManifest"]:
        """Parse a stored record (JSON text, as published, or its dict); ``None`` if it is malformed, its hash
        does not match its contents, or the creator's signature does not check."""
        if isinstance(record, str):
            try:
                record = json.loads(record)
            except ValueError:
                return None
        if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
            return None
        manifest = cls(run_id, dict(record["settings"]), str(record.get("version", "")),
                       str(record.get("creator", "")), str(record.get("signature", "")))
        return manifest if manifest.hash == record.get("hash") and manifest.verified() else None


def publish_manifest(dht: hivemind.DHT, manifest: RunManifest, ttl: float = MANIFEST_TTL,
                     listed_as: Optional[str] = None) -> bool:
    """Store the manifest under the run's key; ``listed_as`` also names a public run in ``RUNS_KEY`` (a private
    run's name stays out of it: its keys are secret)."""
    # JSON text: hivemind's schema validation takes no plain dict as a regular value (dht/validation.py)
    text = json.dumps(manifest.to_record(), sort_keys=True)
    expiration = get_dht_time() + ttl
    if listed_as is not None:
        dht.store(RUNS_KEY, manifest.hash, expiration, subkey=listed_as, return_future=True)
    return bool(dht.store(manifest_key(manifest.run_id), text, expiration, subkey=fingerprint(manifest.creator)))


def runs_seen(dht: hivemind.DHT) -> List[str]:
    """The names of the public runs whose peers listed them lately (``publish_manifest``)."""
    found = dht.get(RUNS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    return sorted(name for name in found.value if isinstance(name, str))


def fetch_manifest(dht: hivemind.DHT, run_id: str, run_key: Optional[str] = None) -> Optional[RunManifest]:
    """The run's manifest (see the module docstring for which one), ``None`` if there is none."""
    found = dht.get(manifest_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    candidates = [RunManifest.from_record(run_id, getattr(item, "value", None)) for item in found.value.values()]
    candidates = [m for m in candidates if m is not None and (run_key is None or m.creator == run_key.strip())]
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    from dht.records import fetch_records  # records import this module's neighbours; keep the import local

    votes = collections.Counter(r.manifest_hash for r in (fetch_records(dht, run_id, timeout=5.0) or {}).values()
                                if r.status != "left")
    return min(candidates, key=lambda m: (-votes[m.hash], m.hash))


def join_or_create(dht: hivemind.DHT, proposal: RunManifest, run_key: Optional[str] = None, create: bool = True,
                   name: Optional[str] = None, listed: bool = True,
                   look_seconds: float = LOOK_SECONDS) -> Tuple[RunManifest, bool]:
    """Adopt the run's manifest if one exists; otherwise, with ``create``, sign and publish ``proposal``. Returns
    the manifest and whether we created the run. ``name``: the run's name as the user typed it (``proposal``'s
    run id is its namespace, which a private run's token changes). Without ``create``, a run that is not found
    within ``look_seconds`` is a ``UserError`` naming the runs that are.

    Two peers that create the same run at once both publish and then both read back, and the same rule
    picks one manifest for both. With ``run_key``, only that creator's manifest is accepted.
    """
    name = name or proposal.run_id
    existing = fetch_manifest(dht, proposal.run_id, run_key)
    deadline = time.monotonic() + look_seconds
    while existing is None and not create and time.monotonic() < deadline:
        time.sleep(0.5)  # a DHT joined a moment ago may not have reached the peers that hold it yet
        existing = fetch_manifest(dht, proposal.run_id, run_key)
    if existing is not None:
        return existing, False
    if run_key is not None:
        raise UserError(f"run '{name}' has no manifest signed by the --run-key you gave: check the key "
                        f"(the creator's `run key:` line), the --run-id, and that the run's peers are up")
    if not create:
        seen = [run for run in runs_seen(dht) if run != name]
        private = " and --run-token" if proposal.run_id != name else ""
        raise UserError(f"no run named '{name}' is reachable through these peers (runs seen: "
                        f"{', '.join(seen) or 'none'}); check --run-id{private}, or pass --new-run to start it")
    signed = proposal if proposal.verified() else proposal.signed()
    publish_manifest(dht, signed, listed_as=name if listed else None)
    chosen = fetch_manifest(dht, proposal.run_id) or signed
    return chosen, chosen.hash == signed.hash and chosen.creator == signed.creator
