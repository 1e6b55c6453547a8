"""Lossless fp32 and half-precision codecs."""

from __future__ import annotations

import numpy as np
import torch

from diloco_compression.base import Codec


def _frombuffer(data: bytes, dtype: np.dtype, numel: int, codec: str) -> np.ndarray:
    expected = numel * np.dtype(dtype).itemsize
    if len(data) != expected:
        raise ValueError(f"{codec}: got {len(data)} bytes for {numel} values, expected {expected}")
    return np.frombuffer(data, dtype=dtype)


class NoneCodec(Codec):
    """Raw little-endian fp32: the baseline every other codec is measured against."""

    name = "none"
    bits_per_value = 32.0

    def encode(self, values: torch.Tensor) -> bytes:
        return self._check_input(values).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        return torch.from_numpy(_frombuffer(data, np.dtype("<f4"), numel, self.name).copy())


class Float16Codec(Codec):
    """IEEE half precision. fp16 -> fp32 is exact, so decoding is identical everywhere.

    Values beyond fp16's range (65504) become inf; the all-reduce rejects non-finite results.
    """

    name = "fp16"
    bits_per_value = 16.0

    def encode(self, values: torch.Tensor) -> bytes:
        return self._check_input(values).to(torch.float16).numpy().astype("<f2", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        # torch's half-to-float is exact and 3-4x faster than numpy's astype
        return torch.from_numpy(_frombuffer(data, np.dtype("<f2"), numel, self.name).copy()).float()
