"""Model presets: the shapes they promise, and identical initial weights on every peer."""

import pytest
import torch
from transformers import LlamaForCausalLM

from peer.presets import PRESETS
from peer.train.model import build_model, count_parameters, model_config
from peer.train.tokenizer import load_tokenizer


@pytest.mark.parametrize("preset, low, high", [("tiny", 2e6, 5e6), ("small", 8e6, 15e6),
                                               ("150m", 150e6, 320e6), ("1b", 1.0e9, 1.3e9)])
def test_preset_sizes(preset, low, high):
    vocab = load_tokenizer(PRESETS[preset].tokenizer).vocab_size
    with torch.device("meta"):  # count the 1b model's parameters without allocating them
        model = LlamaForCausalLM(model_config(preset, vocab, PRESETS[preset].seq_len))
    assert low <= count_parameters(model) <= high


def test_same_seed_same_weights():
    a, b = (build_model("tiny", 256, 64, seed=3) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model("tiny", 256, 64, seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
