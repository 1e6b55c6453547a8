"""Codec round trips and their errors; pure tensors."""

import pytest
import torch

from compression import CODECS, get_codec


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_is_deterministic_and_bounded(name):
    codec = get_codec(name)
    values = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 3
    data = codec.encode(values)
    assert len(data) == values.numel() * codec.bits_per_value / 8
    decoded = codec.decode(data, values.numel())
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    assert torch.equal(decoded, codec.decode(bytes(data), values.numel()))  # same bytes, same values
    relative = ((decoded - values).abs() / values.abs().clamp_min(1e-3)).max().item()
    assert relative <= {"none": 0.0, "fp16": 2**-11}[name]


def test_decode_rejects_a_wrong_size():
    codec = get_codec("fp16")
    with pytest.raises(ValueError, match="fp16: got 6 bytes for 4 values, expected 8"):
        codec.decode(b"\0" * 6, 4)


def test_encode_rejects_non_fp32():
    with pytest.raises(ValueError, match="fp32 CPU"):
        get_codec("none").encode(torch.zeros(3, dtype=torch.float64))


def test_unknown_codec_lists_the_choices():
    with pytest.raises(ValueError, match=r"compression='int3' is not a known codec; choose one of \['fp16', 'none'\]"):
        get_codec("int3")
