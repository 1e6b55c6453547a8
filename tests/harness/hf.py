"""Small Hugging Face models the tests make themselves: ``save_pretrained`` of a tiny random config, nothing
downloaded. Their tokenizer is the byte tokenizer as ``transformers`` saves it (ids are UTF-8 bytes)."""

from __future__ import annotations

from pathlib import Path

import torch

from peer.train.tokenizer import ByteTokenizer

SHAPES = {
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}


def tiny_model(directory: Path, kind: str = "gpt2", seed: int = 0, tokenizer: bool = True, **changes) -> Path:
    """A randomly initialised ``kind`` model of ~0.1M parameters saved to ``directory``, with the byte tokenizer
    (not beside a qwen2 config: ``AutoTokenizer`` gives a qwen2 directory Qwen2's tokenizer class, which adds a
    token)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind, **{"vocab_size": 256, "bos_token_id": None, "eos_token_id": None,
                                           **SHAPES[kind], **changes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if tokenizer:
        ByteTokenizer().as_transformers().save_pretrained(directory)
    return directory
