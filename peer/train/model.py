"""The model of a run: a Llama preset (``peer/presets.py``), built by ``peer/train/llama.py`` without transformers, or
any causal LM that ``transformers`` builds from a config (``peer/train/source.py`` says where the config and weights
come from). ``transformers_model`` gives a preset as transformers' ``LlamaForCausalLM``, for ``peer export``.
"""

from __future__ import annotations

import torch

from dht.errors import UserError
from peer.presets import PRESETS
from peer.train.llama import Llama, LlamaShape
from peer.train.source import is_preset, positions


def preset_shape(preset_name: str, vocab_size: int, seq_len: int) -> LlamaShape:
    preset = PRESETS[preset_name]
    return LlamaShape(vocab_size=vocab_size, hidden=preset.hidden, layers=preset.layers, heads=preset.heads,
                      kv_heads=preset.kv_heads, intermediate=preset.intermediate,
                      tied=preset_name in ("tiny", "small"), positions=max(seq_len, 128))


def model_config(preset_name: str, vocab_size: int, seq_len: int):
    """The transformers LlamaConfig of a preset: what ``peer export`` saves as config.json."""
    from transformers import LlamaConfig  # slow import: only export and the tests need it

    shape = preset_shape(preset_name, vocab_size, seq_len)
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.positions, tie_word_embeddings=shape.tied, use_cache=False,
    )  # its defaults are LlamaShape's: RMSNorm eps 1e-6, RoPE theta 10000, init std 0.02 (tests/test_model.py)


def build_model(preset_name: str, vocab_size: int, seq_len: int, seed: int) -> torch.nn.Module:
    """A freshly initialised preset; the same (preset, vocab, seq_len, seed) gives the same weights on CPU (and the
    same as transformers' LlamaForCausalLM of ``model_config`` seeded alike)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Llama(preset_shape(preset_name, vocab_size, seq_len))


def build_run_model(run, vocab_size: int) -> torch.nn.Module:
    """The model of ``run`` (localized: a Hugging Face model's weights, if it starts from them, are on this node), in
    fp32: a preset's, or a Hugging Face config's, freshly initialised with ``run.seed`` or loaded from the weights."""
    if is_preset(run.model):
        return build_model(run.model, vocab_size, run.seq_len, run.seed)
    from transformers import AutoModelForCausalLM

    config = _hf_config(run, vocab_size)
    if run.init_from_pretrained:
        return AutoModelForCausalLM.from_pretrained(run.model, config=config, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def transformers_model(run, vocab_size: int) -> torch.nn.Module:
    """The architecture of ``run`` as a transformers model (weights not meaningful: the caller copies G in), with the
    same ``parameters()`` order as ``build_run_model``'s: what ``peer export`` saves."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if is_preset(run.model):
        return LlamaForCausalLM(model_config(run.model, vocab_size, run.seq_len))
    return AutoModelForCausalLM.from_config(_hf_config(run, vocab_size), dtype=torch.float32)


def _hf_config(run, vocab_size: int):
    from transformers import AutoConfig

    config = AutoConfig.for_model(**run.model_config)
    config.use_cache = False
    if vocab_size > config.vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} tokens but the model's vocabulary only {config.vocab_size}; "
                        f"pass the model's own --tokenizer, or a model built for this one")
    limit = positions(run.model_config)
    if limit and run.seq_len > limit:
        raise UserError(f"--seq-len {run.seq_len} is longer than the model's {limit} positions; pass a "
                        f"--seq-len of at most {limit}")
    return config


def quiet_transformers() -> None:
    """No progress bars or advice from transformers while it loads and saves models: our lines say what happens.
    Without importing it (3 s, most of a restart's budget) where nothing has yet: then its own settings, read when
    something imports it (a Hugging Face model, export), keep it quiet; a user's own settings win."""
    import logging
    import os
    import sys

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # it read its settings at import: tell it
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
