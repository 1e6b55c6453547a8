"""The codec interface every wire format implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Codec(ABC):
    """Encodes a flat fp32 CPU tensor into bytes and back.

    ``decode(encode(x))`` need not equal ``x`` (lossy codecs), but ``decode`` must be a pure function of
    the bytes: every peer that decodes the same bytes gets bit-identical fp32 values.
    """

    name: str
    bits_per_value: float  # nominal wire cost per fp32 value, used to size parts before encoding
    fixed_size = True  # encode's size depends on the count of values only (else wire_bytes is an upper bound)
    # decode(encode(v)) == v for decoded values v, in parts that start on a block's boundary: values this codec
    # decoded can be served again as a result (a lone step's, peer/averaging/results.py)
    reencodes_exactly = True

    @abstractmethod
    def encode(self, values: torch.Tensor) -> bytes:
        """Encode a 1-D fp32 CPU tensor."""

    @abstractmethod
    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Decode ``numel`` values from ``data`` into a new 1-D fp32 tensor; ValueError if the size is wrong."""

    def wire_bytes(self, numel: int) -> int:
        """Size of ``encode`` for ``numel`` values: exact where ``fixed_size``."""
        return int(numel * self.bits_per_value) // 8

    def ratio(self) -> float:
        """Wire bytes per fp32 byte (1.0 = uncompressed)."""
        return self.bits_per_value / 32.0

    @staticmethod
    def _check_input(values: torch.Tensor) -> torch.Tensor:
        if values.dtype != torch.float32 or values.device.type != "cpu":
            raise ValueError(f"codecs take fp32 CPU tensors, got {values.dtype} on {values.device}")
        return values.detach().reshape(-1).contiguous()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
