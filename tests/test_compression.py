"""Codecs and error feedback: pure tensors, no network."""

import zlib

import numpy as np
import pytest
import torch
from diloco_compression import CODECS, get_codec
from diloco_compression.feedback import ErrorFeedback

from peer.config import RunConfig
from peer.train.data import load_corpus
from peer.train.flat import FlatLayout
from peer.train.inner import InnerTrainer
from peer.train.model import build_model
from peer.train.tokenizer import ByteTokenizer

# relative L2 error of decode(encode(x)); int8, int4 and int4-huffman measured ~0.013, ~0.096 and ~0.172 on a
# Gaussian (int4-huffman's coarser grid leaves more to error feedback)
BOUNDS = {"none": 0.0, "fp16": 1e-3, "int8": 0.03, "int4": 0.16, "int4-huffman": 0.3}
RATIOS = {"none": 1.0, "fp16": 0.5, "int8": 0.2505, "int4": 0.1329, "int4-huffman": 0.115}  # wire / fp32 bytes


@pytest.fixture(scope="module")
def pseudo_gradient():
    """A real pseudo-gradient: G - theta after 8 AdamW steps of the tiny model on Shakespeare."""
    run = RunConfig(batch_size=4, seq_len=64, lr=3e-3, warmup_steps=1).resolved()
    model = build_model("tiny", 256, 64, seed=0)
    trainer = InnerTrainer(model, run, torch.device("cpu"))
    layout = FlatLayout(trainer.params)
    start = layout.gather(trainer.params, layout.empty())
    stream = load_corpus("shakespeare", ByteTokenizer(), 64, 0.02).stream(0, "test", 0)
    trainer.train(iter(lambda: stream.next_batch(4), None), 8, global_step=0)
    return start - layout.gather(trainer.params, layout.empty())


def relative_error(x, y):
    return ((x - y).norm() / x.norm()).item()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_error_and_size(name, pseudo_gradient):
    codec = get_codec(name)
    gaussian = torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 3
    for values in (gaussian, pseudo_gradient):
        data = codec.encode(values)
        if codec.fixed_size:
            assert len(data) == codec.wire_bytes(values.numel())
        else:
            assert len(data) <= codec.wire_bytes(values.numel())
        assert len(data) / (4 * values.numel()) <= RATIOS[name] + 1e-4
        decoded = codec.decode(data, values.numel())
        assert decoded.dtype == torch.float32 and decoded.shape == values.shape
        assert relative_error(values, decoded) <= BOUNDS[name]


@pytest.mark.parametrize("name", ["int8", "int4", "int4-huffman"])
def test_decoding_is_a_plain_table_lookup_and_product(name):
    """Every peer must turn the same bytes into the same bits: check against numpy's float32 product."""
    codec = get_codec(name)
    values = torch.randn(10_001, generator=torch.Generator().manual_seed(1))
    data = codec.encode(values)
    blocks = codec.blocks(values.numel())
    absmax = np.frombuffer(data, dtype="<f4", count=blocks)
    codes = np.frombuffer(data, dtype=np.uint8, offset=4 * blocks)
    if name == "int4-huffman":  # a raw deflate stream of packed codes
        codes = np.frombuffer(zlib.decompress(data[4 * blocks:], -15), dtype=np.uint8)
    if name != "int8":
        codes = np.stack([codes >> 4, codes & 0x0F], axis=1).reshape(-1)[: values.numel()]
    reference = codec.code.numpy()[codes] * np.repeat(absmax, codec.block)[: values.numel()]
    assert np.array_equal(codec.decode(data, values.numel()).numpy(), reference.astype(np.float32))


@pytest.mark.parametrize("name", ["int8", "int4", "int4-huffman"])
def test_re_encoding_keeps_scales_and_nearly_all_codes(name):
    codec = get_codec(name)
    values = torch.randn(1 << 20, generator=torch.Generator().manual_seed(2))
    first = codec.encode(values)
    again = codec.encode(codec.decode(first, values.numel()))
    scales = 4 * codec.blocks(values.numel())
    assert first[:scales] == again[:scales]
    if name == "int4-huffman":  # every decoded value sits on the grid: the very same bytes
        assert first == again
        return
    moved = np.count_nonzero(np.frombuffer(first[scales:], np.uint8) != np.frombuffer(again[scales:], np.uint8))
    assert moved <= 1e-3 * values.numel()


def test_huffman_coding_shrinks_heavy_tails_below_int4():
    """Heavy-tailed values (Laplace here; the sweep's pseudo-gradients after H=100 steps have kurtosis ~6.5 and
    took 2.7 bits) crowd a uniform grid's levels near zero, so their codes code short; NF4 spreads its levels to
    fit a normal block, so its codes are used about equally and stay at 4 bits plus scales."""
    values = torch.distributions.Laplace(0.0, 1.0).sample((1 << 20,))
    huffman, nf4 = (8 * len(get_codec(name).encode(values)) / values.numel() for name in ("int4-huffman", "int4"))
    assert huffman < 2.5 and nf4 == 4.25, (huffman, nf4)


def deflate_raw(data: bytes, level: int) -> bytes:
    """A raw deflate stream, as the codec writes (zlib.compress takes wbits from Python 3.11 only)."""
    coder = zlib.compressobj(level, zlib.DEFLATED, -15)
    return coder.compress(data) + coder.flush()


@pytest.mark.parametrize("damage, message", [
    (lambda data, scales: data[:-3], "the code stream breaks off after .* bytes of codes, expected 5000 for 10000"),
    (lambda data, scales: data + b"extra", "5 bytes follow the code stream"),
    (lambda data, scales: data[:scales] + bytes(len(data) - scales), "the code stream is corrupt"),
    (lambda data, scales: data[:scales - 1], "got 3 bytes for 10000 values, expected at least 4"),
    (lambda data, scales: data[:scales] + deflate_raw(b"\xff" * 5000, 1), "code 15 is not on the grid"),
    (lambda data, scales: data[:scales] + deflate_raw(bytes(100), 1), "the code stream ends after 100 bytes"),
    (lambda data, scales: data[:scales] + deflate_raw(bytes(1 << 24), 9), "the code stream goes on past the"),
])
def test_huffman_decode_names_a_damaged_part(damage, message):
    """A damaged or hostile part is a ValueError naming the problem (the all-reduce rejects the part); a stream
    that would inflate past the part's size is cut at it, never inflated whole."""
    codec = get_codec("int4-huffman")
    data = codec.encode(torch.randn(10_000, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match=f"^int4-huffman: {message}"):
        codec.decode(damage(data, 4 * codec.blocks(10_000)), 10_000)


def test_decode_rejects_a_wrong_size():
    with pytest.raises(ValueError, match="fp16: got 6 bytes for 4 values, expected 8"):
        get_codec("fp16").decode(b"\0" * 6, 4)
    with pytest.raises(ValueError, match="int8: got 3 bytes for 4 values, expected 8"):
        get_codec("int8").decode(b"\0" * 3, 4)


def test_encode_rejects_non_fp32():
    with pytest.raises(ValueError, match="fp32 CPU"):
        get_codec("none").encode(torch.zeros(3, dtype=torch.float64))


def test_unknown_codec_lists_the_choices():
    with pytest.raises(ValueError, match=r"compression='int3' is not a known codec; choose one of \['fp16', 'int4', "):
        get_codec("int3")


@pytest.mark.parametrize("name", ["int8", "int4", "int4-huffman"])
def test_error_feedback_keeps_the_sum_of_contributions_on_track(name, pseudo_gradient):
    codec = get_codec(name)
    rounds, n = 20, pseudo_gradient.numel()
    generator = torch.Generator().manual_seed(3)
    with_feedback, without = ErrorFeedback(codec, n), ErrorFeedback(codec, n, enabled=False)
    true_sum, sent_sum, plain_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    one_round_error = 0.0
    for _ in range(rounds):
        scale = 0.5 + torch.rand(1, generator=generator)
        delta = pseudo_gradient * scale + 1e-4 * torch.randn(n, generator=generator)
        true_sum += delta
        sent = delta.clone()
        with_feedback.commit(sent)
        sent_sum += sent
        plain = delta.clone()
        without.commit(plain)
        plain_sum += plain
        one_round_error = max(one_round_error, (delta - plain).norm().item())
    # what was sent tracks the truth up to exactly the residual, which stays at one round's error
    torch.testing.assert_close(true_sum - sent_sum, with_feedback.residual, rtol=0, atol=1e-5)
    assert with_feedback.residual.norm().item() <= 1.5 * one_round_error
    assert (true_sum - sent_sum).norm() < 0.5 * (true_sum - plain_sum).norm()


def test_quantize_leaves_the_residual_until_commit():
    codec = get_codec("int4")
    feedback = ErrorFeedback(codec, 1000)
    feedback.residual += 0.01
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    out = torch.empty(1000)
    feedback.quantize(delta, out)
    assert torch.all(feedback.residual == 0.01)  # a failed all-reduce attempt must not lose it
    assert torch.equal(out, codec.decode(codec.encode(delta + 0.01), 1000))
    assert ErrorFeedback(get_codec("none"), 1000).residual is None


def test_lossless_bound_sees_the_redundancy_of_skewed_codes():
    """bench.entropy's measures: a normal block uses NF4's 16 codes about equally (entropy near 4 bits), while a
    block of one large value among small ones uses few codes; the wire is 4.25 bits a value either way."""
    from bench.entropy import part_bits

    codec, generator = get_codec("int4"), torch.Generator().manual_seed(0)
    normal = torch.randn(1 << 16, generator=generator)
    skewed = torch.randn(1 << 16, generator=generator) * 1e-3
    skewed[:: codec.block] = 1.0  # every block's absmax dwarfs the rest: nearly all codes land on the middle ones
    for values in (normal, skewed):
        assert part_bits(codec, values)["wire"] == 4.25 * values.numel()
    normal_bits, skewed_bits = part_bits(codec, normal), part_bits(codec, skewed)
    assert 3.7 * normal.numel() < normal_bits["order-0 entropy"] < 4.25 * normal.numel()
    assert skewed_bits["order-0 entropy"] < 1.5 * skewed.numel() and skewed_bits["zlib"] < 2 * skewed.numel()
