"""Model presets: the shapes they promise, identical initial weights on every peer, and our Llama
(``peer/train/llama.py``) computing what transformers' LlamaForCausalLM does, with the same parameter layout."""

import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

from peer.presets import PRESETS
from peer.train.llama import Llama
from peer.train.model import build_model, count_parameters, model_config, preset_shape
from peer.train.tokenizer import load_tokenizer


@pytest.mark.parametrize("preset, low, high", [("tiny", 2e6, 5e6), ("small", 8e6, 15e6),
                                               ("150m", 150e6, 320e6), ("1b", 1.0e9, 1.3e9)])
def test_preset_sizes(preset, low, high):
    vocab = load_tokenizer(PRESETS[preset].tokenizer).vocab_size
    with torch.device("meta"):  # count the 1b model's parameters without allocating them
        model = build_model(preset, vocab, PRESETS[preset].seq_len, seed=0)
    assert low <= count_parameters(model) <= high


def test_same_seed_same_weights():
    a, b = (build_model("tiny", 256, 64, seed=3) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model("tiny", 256, 64, seed=4)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_has_transformers_parameter_names_shapes_and_order(preset):
    """The flat layout (G, checkpoints, ``peer export``) is ``parameters()`` order: ours must be transformers'."""
    vocab = load_tokenizer(PRESETS[preset].tokenizer).vocab_size
    with torch.device("meta"):
        ours = build_model(preset, vocab, PRESETS[preset].seq_len, seed=0)
        theirs = LlamaForCausalLM(model_config(preset, vocab, PRESETS[preset].seq_len))
    shapes = lambda model: [(name, tuple(p.shape)) for name, p in model.named_parameters()]  # noqa: E731
    assert shapes(ours) == shapes(theirs)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())  # a tied head is in both state dicts


def transformers_twin(model: Llama, config) -> LlamaForCausalLM:
    theirs = LlamaForCausalLM(config).eval()
    theirs.load_state_dict(model.state_dict())
    return theirs


@pytest.mark.parametrize("preset", ["micro", "tiny", "grouped"])
def test_our_llama_computes_what_transformers_computes(preset):
    """Same seeded weights as transformers' (bit for bit), then the same loss and gradients on the same weights;
    ``grouped`` is tiny with 2 KV heads for 4 query heads (the 1b preset's grouped attention, at a CPU's size)."""
    name = "tiny" if preset == "grouped" else preset
    shape, config = preset_shape(name, 256, 64), model_config(name, 256, 64)
    if preset == "grouped":
        shape, config.num_key_value_heads = dataclasses.replace(shape, kv_heads=2), 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        ours = Llama(shape)
        torch.manual_seed(7)
        fresh = LlamaForCausalLM(config)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), fresh.parameters()))
    with torch.no_grad():  # trained weights, not only the initial ones: norms away from 1
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    theirs = transformers_twin(ours, config)
    batch = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    mine, reference = ours(input_ids=batch, labels=batch).loss, theirs(input_ids=batch, labels=batch).loss
    assert mine.item() == pytest.approx(reference.item(), abs=1e-5)
    mine.backward()
    reference.backward()
    for (name_, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name_
    assert torch.allclose(ours(input_ids=batch).logits, theirs(input_ids=batch).logits, atol=1e-5)
