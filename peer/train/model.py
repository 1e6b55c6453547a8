"""The model: a Llama-style causal LM built offline from a transformers config of a preset (``peer/presets.py``)."""

from __future__ import annotations

import torch

from peer.presets import PRESETS


def model_config(preset_name: str, vocab_size: int, seq_len: int):
    """The transformers LlamaConfig of a preset."""
    from transformers import LlamaConfig  # slow import: keep it off the CLI's error paths

    preset = PRESETS[preset_name]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=preset_name in ("tiny", "small"),
        use_cache=False,
    )


def build_model(preset_name: str, vocab_size: int, seq_len: int, seed: int) -> torch.nn.Module:
    """A freshly initialised model; the same (preset, vocab, seq_len, seed) gives the same weights on CPU."""
    from transformers import LlamaForCausalLM

    config = model_config(preset_name, vocab_size, seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
