"""Signed, schema-checked DHT records: no peer can overwrite another's, and malformed values are not stored.

- Every process signs with its own RSA key (hivemind's ``RSASignatureValidator``, one key per process).
  A peer's record lives under the subkey ``<peer id>[owner:<its public key>]``, so only the holder of
  that key can write it: a record signed by any other key, or not signed, is refused by every node
  that stores it and by every reader. ``start_dht`` installs the validator on every node we start
  (bootstrap, peers, ``status``), so all of them check.
- Within a run, values must match a schema (hivemind's ``SchemaValidator`` with pydantic): a peer
  record's fields and their types, and the manifest's shape. A malformed store is refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase

Number = Union[pydantic.StrictInt, pydantic.StrictFloat]
OWNER = b"[owner:"


def signer() -> RSASignatureValidator:
    """The validator holding this process's key (hivemind keeps one RSA key per process)."""
    return RSASignatureValidator()


def record_subkey(peer_id: str) -> bytes:
    """Where a peer's record lives: its id, then its public key, which protects the record."""
    return peer_id.encode() + signer().local_public_key


def subkey_peer_id(subkey: Any) -> Optional[str]:
    """The peer id a subkey names, or None if it is not ``record_subkey``'s shape."""
    if not isinstance(subkey, bytes) or OWNER not in subkey:
        return None
    return subkey.split(OWNER, 1)[0].decode(errors="replace")


class PeerRecordModel(pydantic.BaseModel):
    peer_id: pydantic.StrictStr
    epoch: pydantic.conint(strict=True, ge=0)
    state_hash: pydantic.StrictStr
    tokens_total: pydantic.conint(strict=True, ge=0)
    manifest_hash: pydantic.StrictStr
    status: pydantic.StrictStr
    loss: Optional[Number]
    tokens_per_second: Number
    next_sync_at: Optional[Number]
    round_seconds: Optional[Number]
    busy_until: Optional[Number]
    client_mode: pydantic.StrictBool
    bytes_per_round: pydantic.conint(strict=True, ge=0)
    updated_at: Number
    expires_at: Number

    class Config:
        extra = pydantic.Extra.forbid


class RunSchema(pydantic.BaseModel):
    """The keys of one run: ``{run}_peers`` (one signed record per peer) and ``{run}_manifest`` (JSON text per
    creator fingerprint, whose hash and signature ``RunManifest.from_record`` checks)."""

    peers: Dict[BytesWithPublicKey, PeerRecordModel]
    manifest: Dict[pydantic.StrictStr, pydantic.StrictStr]


def run_validators(run_id: str) -> List[RecordValidatorBase]:
    return [signer(), SchemaValidator(RunSchema, prefix=run_id)]
