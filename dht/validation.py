"""Signed, schema-checked DHT records: no peer can overwrite another's, and malformed values are not stored.

- Every process signs with its own RSA key (hivemind's ``RSASignatureValidator``, one key per process).
  A peer's record lives under the subkey ``<peer id>[owner:<its public key>]``, so only the holder of
  that key can write it: a record signed by any other key, or not signed, is refused by every node
  that stores it and by every reader. ``start_dht`` installs the validator on every node we start
  (bootstrap, peers, ``status``), so all of them check.
- A peer signs with the key of its p2p identity (``adopt_identity``): its peer id is the hash of the
  owner key in its subkey, so a reader checks that a record's peer id belongs to its signer
  (``subkey_peer_id``). No one can publish a record in another peer's name under a key of their own.
- Within a run, values must match a schema (hivemind's ``SchemaValidator`` with pydantic): a peer
  record's fields and their types, and the manifest's shape. A malformed store is refused.
- A node checks each record once (``RememberingValidator``): every reply to a lookup carries the whole dictionary
  of a run's records, and checking them all again in every reply was most of a DHT process's work.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any, Dict, Iterable, List, Optional, Union

import base58
import multihash
import pydantic.v1 as pydantic
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2

from dht import internals

Number = Union[pydantic.StrictInt, pydantic.StrictFloat]
OWNER = b"[owner:"


def signer() -> RSASignatureValidator:
    """The validator holding this process's key (hivemind keeps one RSA key per process)."""
    return RSASignatureValidator()


def record_subkey(peer_id: str) -> bytes:
    """Where a peer's record lives: its id, then its public key, which protects the record."""
    return peer_id.encode() + signer().local_public_key


def adopt_identity(identity_path: str) -> None:
    """Sign this process's records with the RSA key of its p2p identity file (hivemind's format: a libp2p
    PrivateKey protobuf holding a DER key). Call it before any validator or subkey is made."""
    with open(identity_path, "rb") as file:
        der = crypto_pb2.PrivateKey.FromString(file.read()).data
    internals.sign_records_with(internals.rsa_key(der))


def peer_id_of(owner_key: bytes) -> str:
    """The libp2p peer id of an RSA public key in OpenSSH form: the sha2-256 multihash of the key's
    protobuf (libp2p's peer-id spec, as hivemind's ``PeerID.from_identity`` computes it)."""
    public = serialization.load_ssh_public_key(owner_key).public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def signing_peer_id() -> str:
    """The peer id of the key this process signs its records with (its p2p identity's, once adopted)."""
    return peer_id_of(signer().local_public_key[len(OWNER):-1])


def subkey_peer_id(subkey: Any) -> Optional[str]:
    """The peer id a subkey names, or None if it is not ``record_subkey``'s shape or its owner key is not
    that peer's identity (a record published in another peer's name)."""
    if not isinstance(subkey, bytes) or OWNER not in subkey or not subkey.endswith(b"]"):
        return None
    claimed, owner = subkey.split(OWNER, 1)
    try:
        owner_id = peer_id_of(owner[:-1])
    except (ValueError, TypeError):
        return None
    return owner_id if owner_id == claimed.decode(errors="replace") else None


class PeerRecordModel(pydantic.BaseModel):
    peer_id: pydantic.StrictStr
    epoch: pydantic.conint(strict=True, ge=0)
    state_hash: pydantic.StrictStr
    tokens_total: pydantic.conint(strict=True, ge=0)
    manifest_hash: pydantic.StrictStr
    status: pydantic.StrictStr
    loss: Optional[Number]
    eval_loss: Optional[Number] = None
    eval_epoch: pydantic.conint(strict=True, ge=-1) = -1
    group_size: pydantic.conint(strict=True, ge=0) = 0
    tokens_per_second: Number
    next_sync_at: Optional[Number]
    round_seconds: Optional[Number]
    busy_until: Optional[Number]
    adopting: Optional[pydantic.StrictStr]
    client_mode: pydantic.StrictBool
    reach: pydantic.StrictStr
    bytes_per_round: pydantic.conint(strict=True, ge=0)
    heartbeat: Number
    updated_at: Number
    expires_at: Number
    seen_at: Number

    class Config:
        extra = pydantic.Extra.forbid


class RunSchema(pydantic.BaseModel):
    """The keys of one run: ``{run}_peers`` (one signed record per peer) and ``{run}_manifest`` (JSON text per
    creator fingerprint, whose hash and signature ``RunManifest.from_record`` checks)."""

    peers: Dict[BytesWithPublicKey, PeerRecordModel]
    manifest: Dict[pydantic.StrictStr, pydantic.StrictStr]


def run_validators(run_id: str) -> List[RecordValidatorBase]:
    return [signer(), SchemaValidator(RunSchema, prefix=run_id)]


class RememberingValidator(RecordValidatorBase):
    """A node's validators, remembering the records they passed. Every reply to a DHT lookup (a heartbeat's store
    looks up its key's nearest nodes first) carries the whole dictionary of a run's peer records, and hivemind
    checks every record's RSA signature and schema in every reply: with 16 peers heartbeating every 2 s, that was
    79% of each DHT process's CPU, and the DHT processes took 1.4 of this machine's 2 cores (``py-spy`` on one,
    ``bench/results/scale.md``). A record (key, subkey, value and expiration: what its signature covers) passes or
    fails alike every time, so only records not seen before are checked; a heartbeat's new expiration makes a new
    one. At most ``size`` records are remembered, the least recently seen forgotten first."""

    def __init__(self, validators: Iterable[RecordValidatorBase], size: int = 4096):
        self.inner, self.size = CompositeValidator(validators), size
        self.passed: "collections.OrderedDict[DHTRecord, None]" = collections.OrderedDict()
        self.lock = threading.Lock()

    def validate(self, record: DHTRecord) -> bool:
        with self.lock:
            if record in self.passed:
                self.passed.move_to_end(record)
                return True
        if not self.inner.validate(record):
            return False
        with self.lock:
            self.passed[record] = None
            if len(self.passed) > self.size:
                self.passed.popitem(last=False)
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Take in a validator added later (``DHT.add_validators``: hivemind.Optimizer adds its own signature
        validator), so that it merges with ours as hivemind merges them; beside ours instead, it signed each record a
        second time and no record passed. What passed before is checked again."""
        self.inner.extend([other])
        with self.lock:
            self.passed.clear()
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.inner.strip_value(record)

    def __getstate__(self) -> dict:  # a spawned DHT process starts with nothing remembered
        return dict(inner=self.inner, size=self.size)

    def __setstate__(self, state: dict) -> None:
        self.__init__((), state["size"])
        self.inner = state["inner"]
