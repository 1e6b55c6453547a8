"""The presets' Llama, in plain torch: what transformers' ``LlamaForCausalLM`` computes, without importing it.

transformers' Llama costs 3.2 s of CPU to import here (``modeling_llama`` with transformers 5.24; 1.1 s of it is
torch._dynamo, which AdamW imports anyway), against a restart's 3 s (docs/design.md, "Models in and out" and
"Startup"). This module holds the same model: the same parameter names, shapes and
``parameters()`` order (so a flat vector of one is a flat vector of the other: checkpoints, ``peer export``), the
same seeded initial weights (bit for bit: modules built and initialised in transformers' order), and the same
forward math: RMSNorm, rotary embeddings (theta 10000, halves rotated), causal SDPA attention with grouped KV heads,
a SiLU-gated MLP, a head tied to the embedding or not, and the shifted causal-LM loss. ``tests/test_model.py`` loads
one set of weights into both and compares their losses and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa (torch 2.5)


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool  # the output head is the embedding's matrix
    positions: int  # max_position_embeddings of the matching transformers config (RoPE has no table: unused here)
    eps: float = 1e-6  # RMSNorm epsilon (LlamaConfig.rms_norm_eps)
    rope_theta: float = 10000.0
    init_std: float = 0.02  # LlamaConfig.initializer_range

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Output(NamedTuple):
    loss: Optional[torch.Tensor]
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        grouped = {}
        if self.kv_heads != self.heads:  # grouped KV heads: each serves heads / kv_heads query heads
            if GQA:  # without copies of k and v (at 1b, 8x their memory, saved for backward in every layer)
                grouped = dict(enable_gqa=True)
            else:
                k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=length > 1, **grouped)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):  # transformers' LlamaDecoderLayer
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.self_attn, self.mlp = Attention(s), MLP(s)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(s.hidden, s.eps), RMSNorm(s.hidden, s.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):  # transformers' LlamaModel: the attribute names make the parameter names
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden, s.eps)
        inverse = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float) / s.head_dim))
        self.register_buffer("inv_freq", inverse, persistent=False)


class Llama(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.shape = shape
        self.model = Body(shape)
        # transformers' order: the body is initialised, then the head is built and initialised; a tied head then
        # takes the embedding's matrix (and its values)
        self._initialise(self.model)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab_size, bias=False)
        self._initialise(self.lm_head)
        if shape.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def _initialise(self, module: nn.Module) -> None:
        """transformers' ``_init_weights``, children before parents as its ``smart_apply`` goes: every matrix from
        N(0, init_std), norms at one."""
        for child in module.children():
            self._initialise(child)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, self.shape.init_std)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Output:
        x = self.model.embed_tokens(input_ids)
        angles = torch.arange(input_ids.shape[1], device=x.device).float()[:, None] * self.model.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))
        loss = None
        if labels is not None:  # position t predicts token t+1; the last position has no target
            targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        return Output(loss, logits)
