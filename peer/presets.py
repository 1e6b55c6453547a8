"""Model presets: the shape of each built-in Llama and the run defaults that go with it.

``tiny`` and ``small`` use a byte vocabulary and train on a CPU; ``150m`` and ``1b`` are the Llama
shapes DiLoCo and OpenDiLoCo use for real runs on GPUs (with GPT-2's BPE vocabulary here).
"""

from __future__ import annotations

from dataclasses import dataclass


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

# run defaults for a Hugging Face model (``--model DIR`` or a hub name): continued pretraining of a small open
# model, at a fine-tuning learning rate; its own tokenizer unless --tokenizer says otherwise
HF_DEFAULTS = Preset(0, 0, 0, 0, 0, "", 512, 8, 1e-4, 100, 100)


def run_defaults(model: str) -> Preset:
    return PRESETS.get(model, HF_DEFAULTS)
