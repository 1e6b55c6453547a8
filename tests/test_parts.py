"""How an all-reduce cuts its vector into parts (``parts.part_bytes``): balanced shares, whole codec blocks."""

import pytest
import torch
from diloco_compression import CODECS, get_codec

from peer.averaging.parts import PART_BYTES, CodecCompression, ExactPartContainer, part_bytes

FRAGMENT = 2_800_000  # about one fragment of the small preset (10.7M values) at --fragments 4


def shares(values: int, reducers: int, codec: str, size: int) -> list:
    """Values each of ``reducers`` equal members reduces, as hivemind's container deals the parts."""
    container = ExactPartContainer([torch.zeros(values)], (1.0,) * reducers,
                                   compression=CodecCompression(get_codec(codec)), part_size_bytes=size)
    return [sum(part.numel() for part in container.get_raw_input_parts(i)) for i in range(reducers)]


@pytest.mark.parametrize("reducers", [2, 3, 4, 8])
def test_each_member_reduces_within_a_part_of_an_equal_share(reducers):
    balanced = FRAGMENT / reducers
    dealt = shares(FRAGMENT, reducers, "int4-huffman", part_bytes(FRAGMENT, reducers, get_codec("int4-huffman")))
    assert sum(dealt) == FRAGMENT
    assert max(dealt) <= 1.2 * balanced, dealt
    # the fixed 1 MiB parts this replaced: 2 parts for 4 reducers, one of them reducing three quarters
    if reducers == 4:
        assert max(shares(FRAGMENT, 4, "int4-huffman", PART_BYTES[1])) >= 2.9 * balanced


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("values", [1_000, FRAGMENT, 11_000_000, 1_100_000_000])
def test_parts_are_whole_codec_blocks_and_bounded(codec, values):
    size = part_bytes(values, 4, get_codec(codec))
    assert PART_BYTES[0] <= size <= PART_BYTES[1]
    part_values = int(size / (4 * CodecCompression(get_codec(codec)).estimate_compression_ratio(None)))
    assert part_values % getattr(get_codec(codec), "block", 1) == 0
