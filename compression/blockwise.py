"""Blockwise quantization: int8 (bitsandbytes' dynamic 8-bit code) and int4 (NF4), one fp32 scale per block.

Wire format of one encoded part: ``[absmax: fp32 x blocks][codes: uint8 x n, or nibbles packed two a byte]``.

bitsandbytes does the encoding (the choice of code per value: its CPU kernels are fast). Decoding is
defined as a table lookup and one multiply per value, ``code[index] * absmax`` in float32: a single
IEEE-rounded product, the same on every CPU (``_decode_reference``). bitsandbytes' CPU dequantizers
are faster but take other paths on other CPUs (AVX-512 among them), and every peer must turn the same
bytes into the same bits; so they are used only where a self-check shows they match the reference.

Re-encoding decoded values gives back almost the same bytes: each block's largest value decodes to
exactly its absmax (so the scales match), and bitsandbytes' search maps all but ~0.01% of values
that sit exactly on a code back to that code (measured: 1,475 of 16.8M moved one code step). So a
pseudo-gradient quantized for error feedback before the all-reduce, which encodes it again part by
part on block boundaries, loses next to nothing more.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from diloco_compression.base import Codec


def _bnb_functional():
    # bitsandbytes warns at import that an optional CPU kernel package is missing; we do not use it
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes.functional as functional

    return functional


def _read_only_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over the received bytes without copying them; only ever read (bitsandbytes' dequantizers
    do not write their inputs), so torch's warning about a non-writable array does not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(array)


class BlockwiseCodec(Codec):
    """Shared by int8 and int4: scales and codes on the wire, decoding in torch."""

    block: int
    code_bits: int

    def __init__(self):
        self._code = None
        self._exact = None  # whether bitsandbytes' dequantizer matches the reference here

    @property
    def code(self) -> torch.Tensor:
        if self._code is None:
            self._code = self._make_code().to(torch.float32).contiguous()
        return self._code

    def _make_code(self) -> torch.Tensor:
        raise NotImplementedError

    def _quantize(self, values: torch.Tensor):
        """(absmax fp32 [blocks], codes uint8 [n]) from bitsandbytes."""
        raise NotImplementedError

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def wire_bytes(self, numel: int) -> int:
        return 4 * self.blocks(numel) + (numel * self.code_bits + 7) // 8

    def encode(self, values: torch.Tensor) -> bytes:
        absmax, codes = self._quantize(self._check_input(values))
        return b"".join((absmax.numpy().astype("<f4", copy=False).data, codes.numpy().data))  # one copy

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        expected = self.wire_bytes(numel)
        if len(data) != expected:
            raise ValueError(f"{self.name}: got {len(data)} bytes for {numel} values, expected {expected}")
        blocks = self.blocks(numel)
        absmax = np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float32, copy=False)
        codes = np.frombuffer(data, dtype=np.uint8, offset=4 * blocks)
        if self._kernel_is_exact():
            return self._decode_kernel(_read_only_tensor(absmax), _read_only_tensor(codes), numel)
        return self._decode_reference(absmax, codes, numel)

    def _decode_reference(self, absmax: np.ndarray, codes: np.ndarray, numel: int) -> torch.Tensor:
        """The definition of decoding: code[index] * absmax, one float32 product per value."""
        return self._scale(self.code.numpy()[self._indices(codes, numel)], absmax)

    def _scale(self, values: np.ndarray, absmax: np.ndarray) -> torch.Tensor:
        """code values (fp32, one a value) times their block's absmax, in place: one float32 product each."""
        full = len(values) // self.block
        values[: full * self.block].reshape(full, self.block)[:] *= absmax[:full, None]
        if len(values) % self.block:
            values[full * self.block:] *= absmax[full]
        return torch.from_numpy(values)

    def _kernel_is_exact(self) -> bool:
        """bitsandbytes' dequantizer is 2-10x faster than the reference, but its CPU kernels take other
        paths on other CPUs. Use it only where it reproduces the reference bit for bit (checked once per
        process, on values that reach every code), so all peers still decode identically."""
        if self._exact is None:
            probe = torch.randn(3 * self.block + 7, generator=torch.Generator().manual_seed(0))
            probe[: self.block] *= torch.linspace(0, 1e3, self.block)
            probe[self.block: 2 * self.block] = 0.0
            data = self.encode(probe)
            blocks = self.blocks(probe.numel())
            absmax = np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float32, copy=False)
            codes = np.frombuffer(data, dtype=np.uint8, offset=4 * blocks)
            try:
                fast = self._decode_kernel(_read_only_tensor(absmax), _read_only_tensor(codes), probe.numel())
                self._exact = torch.equal(fast, self._decode_reference(absmax, codes, probe.numel()))
            except Exception:  # an older or broken bitsandbytes build: the reference is always right
                self._exact = False
        return self._exact

    def _decode_kernel(self, absmax: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def _indices(self, codes: np.ndarray, numel: int) -> np.ndarray:
        return codes


class Int8Codec(BlockwiseCodec):
    """bitsandbytes' dynamic 8-bit code in blocks of 4096: 8.008 bits a value, ~1.3% error on a Gaussian."""

    name = "int8"
    bits_per_value = 8.0  # nominal: sizes hivemind's parts to whole blocks (the scales add 0.1%)
    block = 4096
    code_bits = 8
    reencodes_exactly = False  # the dynamic map's codes near zero are closer than fp32's rounding of value/absmax:
    # re-encoded, 29 of 262,144 decoded values moved to a neighbouring code (tests/test_replay.py)

    def _make_code(self) -> torch.Tensor:
        code = _bnb_functional().create_dynamic_map(signed=True)
        # the dynamic map ends at -0.993 and +1.0; with -1.0 at its low end, a block whose largest value
        # is negative decodes that value to exactly -absmax, so re-encoding keeps the block's scale
        code[0] = -1.0
        return code

    def _quantize(self, values: torch.Tensor):
        codes, state = _bnb_functional().quantize_blockwise(values, code=self.code, blocksize=self.block)
        return state.absmax, codes

    def _decode_kernel(self, absmax: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        return _bnb_functional().dequantize_blockwise(codes, absmax=absmax, code=self.code, blocksize=self.block)


class Int4Codec(BlockwiseCodec):
    """NF4 (bitsandbytes) in blocks of 128: 4.25 bits a value, ~10% error on a Gaussian.

    Blocks of 128 rather than bitsandbytes' default 64 keep the fp32 scales at 0.25 bit a value: with
    64, the wire would carry 4.5 bits (0.141 of fp32) instead of 4.25 (0.133).
    """

    name = "int4"
    bits_per_value = 4.0  # nominal, as for int8
    block = 128
    code_bits = 4

    def _make_code(self) -> torch.Tensor:
        return _bnb_functional().get_4bit_type("nf4", device="cpu")

    def _quantize(self, values: torch.Tensor):
        if values.numel() % 2:  # two codes a byte: pad one zero, which decodes to nothing we keep
            values = torch.cat([values, values.new_zeros(1)])
        packed, state = _bnb_functional().quantize_4bit(values, blocksize=self.block, quant_type="nf4")
        return state.absmax, packed.reshape(-1)

    def _decode_kernel(self, absmax: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        functional = _bnb_functional()
        even = numel + numel % 2
        state = functional.QuantState(absmax=absmax, shape=torch.Size([even]), dtype=torch.float32,
                                      blocksize=self.block, code=self.code, quant_type="nf4")
        return functional.dequantize_4bit(codes, state).reshape(-1)[:numel]

    def _indices(self, codes: np.ndarray, numel: int) -> np.ndarray:
        # bitsandbytes packs the first value of each pair into the high nibble
        pairs = np.empty(2 * len(codes), dtype=np.uint8)
        pairs[0::2], pairs[1::2] = codes >> 4, codes & 0x0F
        return pairs[:numel]
