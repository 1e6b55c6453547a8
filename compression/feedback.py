"""Error feedback: what quantization dropped from our contribution is added to the next one.

    sent     = decode(encode(delta + residual))
    residual = delta + residual - sent

The sum of what a peer sent over any number of rounds equals the sum of its true pseudo-gradients
minus the current residual, which stays bounded by one round's quantization error instead of
growing with the rounds (EF-SGD, Karimireddy et al. 2019; used for DiLoCo's outer gradients in
Streaming DiLoCo, arXiv 2501.18512).

Memory: the residual (one fp32 copy of the model) plus one chunk of temporaries; chunks are whole
codec blocks, aligned with the parts the all-reduce encodes.
"""

from __future__ import annotations

from typing import Optional

import torch

from diloco_compression.base import Codec

CHUNK_VALUES = 1 << 22  # a multiple of every codec's block


def roundtrip(codec: Codec, values: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decode(encode(values)) chunk by chunk; ``out`` may be ``values`` itself."""
    out = torch.empty_like(values) if out is None else out
    for start in range(0, values.numel(), CHUNK_VALUES):
        chunk = values[start: start + CHUNK_VALUES]
        out[start: start + CHUNK_VALUES] = codec.decode(codec.encode(chunk), chunk.numel())
    return out


class ErrorFeedback:
    """Keeps the residual of quantizing this peer's own contributions (None for a lossless codec)."""

    def __init__(self, codec: Codec, numel: int, enabled: bool = True):
        self.codec = codec
        lossless = codec.bits_per_value >= 32
        self.residual = torch.zeros(numel) if enabled and not lossless else None

    def fragment(self, part: slice) -> "ErrorFeedback":
        """The same feedback over one fragment of the vector: its residual is a view of ours, so what a fragment's
        ``commit`` keeps stays in ours (``peer/outer/fragments.py``)."""
        view = ErrorFeedback.__new__(ErrorFeedback)
        view.codec, view.residual = self.codec, None if self.residual is None else self.residual[part]
        return view

    def quantize(self, delta: torch.Tensor, out: torch.Tensor) -> None:
        """out <- decode(encode(delta + residual)): the contribution to send. Leaves the residual alone
        until ``commit``: an attempt that fails must not lose it."""
        for start in range(0, delta.numel(), CHUNK_VALUES):
            chunk = delta[start: start + CHUNK_VALUES]
            if self.residual is not None:
                chunk = chunk + self.residual[start: start + CHUNK_VALUES]
            out[start: start + CHUNK_VALUES] = self.codec.decode(self.codec.encode(chunk), chunk.numel())

    def commit(self, delta: torch.Tensor) -> None:
        """The contribution built from ``delta`` was merged: delta becomes what was sent, and the residual
        keeps what was not (delta + residual - sent). ``delta`` is overwritten in place."""
        for start in range(0, delta.numel(), CHUNK_VALUES):
            chunk = delta[start: start + CHUNK_VALUES]
            if self.residual is not None:
                chunk.add_(self.residual[start: start + CHUNK_VALUES])
            sent = self.codec.decode(self.codec.encode(chunk), chunk.numel())
            if self.residual is not None:
                torch.sub(chunk, sent, out=self.residual[start: start + CHUNK_VALUES])
            chunk.copy_(sent)
