"""Model presets: Llama-style causal LMs built from a transformers config, offline.

``tiny`` and ``small`` use a byte vocabulary and train on a CPU; ``150m`` and ``1b`` are the Llama
shapes DiLoCo and OpenDiLoCo use for real runs on GPUs (with GPT-2's BPE vocabulary here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tokenizer: str  # default tokenizer: "bytes" or "gpt2"
    seq_len: int  # default context length
    batch_size: int  # default sequences per inner step
    lr: float  # default peak inner learning rate
    warmup_steps: int
    inner_steps: int  # default H


PRESETS = {
    # ~0.16M parameters: smoke runs and the test suite's swarms (a step takes milliseconds on one CPU core)
    "micro": Preset(64, 2, 4, 4, 256, "bytes", 64, 8, 6e-3, 50, 100),
    # ~3.2M parameters: the embedded default, a round of 50 steps takes ~20 s on two CPU cores
    "tiny": Preset(256, 4, 4, 4, 688, "bytes", 256, 8, 1e-3, 50, 50),
    # ~10.7M parameters: CPU benchmarks that need more compute per byte sent
    "small": Preset(384, 6, 6, 6, 1024, "bytes", 256, 8, 8e-4, 100, 100),
    # OpenDiLoCo's llama150m shape (hidden 1024, 12 layers, 16 heads, MLP 4096)
    "150m": Preset(1024, 12, 16, 16, 4096, "gpt2", 1024, 64, 4e-4, 1000, 500),
    # TinyLlama-1.1B shape used by OpenDiLoCo's 1B runs (22 layers, hidden 2048, GQA with 4 KV heads)
    "1b": Preset(2048, 22, 32, 4, 5632, "gpt2", 1024, 64, 4e-4, 1000, 500),
}


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
