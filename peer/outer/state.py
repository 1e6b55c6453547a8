"""The global state a peer holds, (G, m, e) and its lineage, and its hash: what every group member must agree on
bit for bit. The outer step that updates it is ``peer/outer/nesterov.py``."""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable

import numpy as np
import torch

MERGED_HISTORY = 4096  # peers remembered in GlobalState.merged (a round of many groups counts its producers)


@dataclass
class GlobalState:
    """What a peer holds of the run: global parameters G, outer momentum m, epoch e, and lineage facts."""

    params: torch.Tensor  # G: flat fp32 CPU
    momentum: torch.Tensor  # m: flat fp32 CPU
    epoch: int = 0
    tokens_total: int = 0  # tokens merged into this lineage; fork choice prefers more
    merged: Dict[str, int] = field(default_factory=dict)  # peer id -> last epoch its delta was merged

    # the last hash(): (epoch and version counters, weak references to G and m, digest)
    _hashed: tuple = field(default=(), init=False, repr=False, compare=False)

    def hash(self) -> str:
        """hash(G, m, e), recomputed only when G, m or e changed since the last call: every write to G or m is a
        torch op, which bumps the tensor's version counter, or a new tensor (a pass over 2x the model saved per
        call; a round asks several times)."""
        key = (self.epoch, self.params._version, self.momentum._version)
        if self._hashed and self._hashed[0] == key and self._hashed[1]() is self.params \
                and self._hashed[2]() is self.momentum:
            return self._hashed[3]
        digest = state_hash(self.params, self.momentum, self.epoch)
        self._hashed = (key, weakref.ref(self.params), weakref.ref(self.momentum), digest)
        return digest

    def metadata(self) -> dict:
        return dict(epoch=self.epoch, tokens_total=self.tokens_total, merged=dict(self.merged), hash=self.hash())


def state_hash(params: torch.Tensor, momentum: torch.Tensor, epoch: int) -> str:
    """hash(G, m, e): SHA-256 over the raw fp32 bytes, read without copies."""
    digest = hashlib.sha256()
    for tensor in (params, momentum):
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("the global state must be contiguous fp32 CPU tensors")
        digest.update(memoryview(tensor.numpy()).cast("B"))
    digest.update(np.int64(epoch).tobytes())
    return digest.hexdigest()[:16]


def merge_contributors(merged: Dict[str, int], peers: Iterable[str], epoch: int) -> Dict[str, int]:
    """Record that ``peers`` contributed to the outer step taken at ``epoch``; keep the newest entries."""
    updated = dict(merged)
    for peer in peers:
        updated[peer] = epoch
    if len(updated) > MERGED_HISTORY:
        updated = dict(sorted(updated.items(), key=lambda kv: (kv[1], kv[0]))[-MERGED_HISTORY:])
    return updated
