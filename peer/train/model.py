"""The model of a run: a Llama preset (``peer/presets.py``), or any causal LM that ``transformers`` builds from a
config (``peer/train/source.py`` says where the config and weights come from). The architectures are transformers'.
"""

from __future__ import annotations

import torch

from dht.errors import UserError
from peer.presets import PRESETS
from peer.train.source import is_preset, positions


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


def build_run_model(run, vocab_size: int) -> torch.nn.Module:
    """The model of ``run`` (localized: a Hugging Face model's weights, if it starts from them, are on this node), in
    fp32: a preset's, or a Hugging Face config's, freshly initialised with ``run.seed`` or loaded from the weights."""
    if is_preset(run.model):
        return build_model(run.model, vocab_size, run.seq_len, run.seed)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**run.model_config)
    config.use_cache = False
    if vocab_size > config.vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} tokens but the model's vocabulary only {config.vocab_size}; "
                        f"pass the model's own --tokenizer, or a model built for this one")
    limit = positions(run.model_config)
    if limit and run.seq_len > limit:
        raise UserError(f"--seq-len {run.seq_len} is longer than the model's {limit} positions; pass a "
                        f"--seq-len of at most {limit}")
    if run.init_from_pretrained:
        return AutoModelForCausalLM.from_pretrained(run.model, config=config, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run.seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def quiet_transformers() -> None:
    """No progress bars or advice from transformers while it loads and saves models: our lines say what happens."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
