"""int4-huffman: a uniform 4-bit integer grid in large blocks, its codes Huffman-coded.

Wire format of one encoded part: ``[absmax: fp32 x blocks][raw deflate stream]``. The stream inflates to
the codes packed two a byte, high nibble first, as int4's are. Code ``k`` in 0..14 stands for
``(k - 7) / 7 * absmax``; 15 is never written and is rejected.

Why it exists: NF4 (``int4``) puts its 16 levels at a normal distribution's quantiles, so a pseudo-gradient
uses them about equally. Its codes carry 3.8 of their 4 bits, and no lossless coder shrinks them much
(bench/results/entropy.md). A uniform grid scaled to each block's largest value is the opposite:
pseudo-gradients are heavy-tailed, so most values land on the few levels near zero, and a Huffman code fitted
to them gets within a few hundredths of a bit of their entropy. The larger the block, the larger its largest
value and the fewer levels the rest use. On the convergence sweep's centre (M=4, H=100, error feedback and
alignment on) the pseudo-gradients took 2.7 bits a value at blocks of 4096 and 2.5 at 16384, with first moments
far less, and the held-out loss matched NF4's at both (bench/results/convergence.md). The error of the coarser
grid goes to the residual that error feedback sends next round.

The coder is zlib's deflate with ``Z_HUFFMAN_ONLY``: no string matching, only a Huffman code fitted to each
deflate block of the codes, and the same standard inflate on every peer. bench/results/compression.md measured it
on Gaussians, side by side with the others: it encodes faster than NF4 (210-336 MB/s of fp32 against 158-172)
and decodes slower (579-770 MB/s against 1.7-4.6 GB/s), with 2.87 bits a value against NF4's 4.25.

Decoding is ``code[k] * absmax``, one float32 product per value, as for int4 and int8: the same bytes give
the same bits on every peer. Re-encoding decoded values gives back the same bytes: each block's largest
value decodes to exactly ``±absmax``, and every other value sits on the grid.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from diloco_compression.blockwise import BlockwiseCodec

LEVELS = 7  # codes 0..14 for -7..7 steps of absmax / 7


class Int4HuffmanCodec(BlockwiseCodec):
    """Uniform int4 (15 levels) in blocks of 16384, Huffman-coded: ~2.5 bits a value on pseudo-gradients, ~2.9 on
    a Gaussian (relative error ~0.17 there, against NF4's ~0.10)."""

    name = "int4-huffman"
    bits_per_value = 4.0  # nominal, and about the most it takes: sizes hivemind's parts before encoding
    fixed_size = False
    block = 16384  # a divisor of CHUNK_VALUES and of hivemind's parts (2**21 values at 4 bits)
    code_bits = 4

    def __init__(self):
        super().__init__()
        self._pairs = None

    def _make_code(self) -> torch.Tensor:
        return torch.arange(-LEVELS, 16 - LEVELS, dtype=torch.float32) / LEVELS

    def wire_bytes(self, numel: int) -> int:
        """An upper bound: the scales, plus zlib's conservative ``deflateBound`` (the one it gives for non-default
        settings, as ours are) over the packed codes."""
        packed = (numel + 1) // 2
        return 4 * self.blocks(numel) + packed + (packed + 7) // 8 + (packed + 63) // 64 + 5

    def encode(self, values: torch.Tensor) -> bytes:
        values = self._check_input(values)
        numel, blocks = values.numel(), self.blocks(values.numel())
        if numel % self.block:  # the last block padded with zeros (code 7, dropped by decode)
            values = torch.cat([values, values.new_zeros(blocks * self.block - numel)])
        rows = values.view(blocks, self.block)
        absmax = rows.abs().amax(dim=1)
        scale = torch.where(absmax > 0, LEVELS / absmax, torch.zeros_like(absmax))
        steps = torch.nan_to_num(torch.round(rows * scale[:, None])).clamp_(-LEVELS, LEVELS)
        codes = (steps + LEVELS).to(torch.uint8).view(-1)[: numel + numel % 2]
        packed = (codes[0::2] << 4) | codes[1::2]
        coder = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
        stream = coder.compress(packed.numpy().data) + coder.flush()
        return absmax.numpy().astype("<f4", copy=False).tobytes() + stream

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        blocks, packed_size = self.blocks(numel), (numel + 1) // 2
        if len(data) < 4 * blocks:
            raise ValueError(f"{self.name}: got {len(data)} bytes for {numel} values, expected at least {4 * blocks}")
        absmax = np.frombuffer(data, dtype="<f4", count=blocks).astype(np.float32, copy=False)
        inflater = zlib.decompressobj(-15)
        try:
            packed = inflater.decompress(memoryview(data)[4 * blocks:], packed_size)  # bounded: no zip bomb
        except zlib.error as e:
            raise ValueError(f"{self.name}: the code stream is corrupt ({e})") from None
        if len(packed) < packed_size:
            raise ValueError(f"{self.name}: the code stream {'ends' if inflater.eof else 'breaks off'} after "
                             f"{len(packed)} bytes of codes, expected {packed_size} for {numel} values")
        if not inflater.eof:
            raise ValueError(f"{self.name}: the code stream goes on past the {packed_size} bytes of codes "
                             f"expected for {numel} values")
        if inflater.unused_data:
            raise ValueError(f"{self.name}: {len(inflater.unused_data)} bytes follow the code stream")
        packed = np.frombuffer(packed, dtype=np.uint8)
        if np.any(packed >= 0xF0) or np.any(packed & 0x0F == 0x0F):
            raise ValueError(f"{self.name}: code 15 is not on the grid (0..{2 * LEVELS})")
        # one lookup a byte for both its codes: 2x faster than unpacking the nibbles and looking each up
        return self._scale(np.take(self.pairs, packed, axis=0).reshape(-1)[:numel], absmax)

    @property
    def pairs(self) -> np.ndarray:
        """The code values of both nibbles of every byte, high nibble first: [256, 2] fp32."""
        if self._pairs is None:
            nibbles = np.arange(256)
            self._pairs = self.code.numpy()[np.stack([nibbles >> 4, nibbles & 0x0F], axis=1)]
        return self._pairs
