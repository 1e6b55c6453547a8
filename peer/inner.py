"""The inner loop: AdamW on the local model, with warmup and cosine decay, clipping and accumulation.

Like nanoGPT's loop, but bounded by a step budget and a wall-clock deadline, so a round ends after H
steps or when the swarm's schedule says so. On CUDA it runs under bf16 autocast with fused AdamW.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Sequence

import torch

from peer.config import RunConfig


@dataclass
class InnerStats:
    steps: int = 0
    tokens: int = 0
    loss: float = float("nan")  # mean training loss over the round's steps
    compute_seconds: float = 0.0
    lr: float = 0.0


class InnerTrainer:
    def __init__(self, model: torch.nn.Module, run: RunConfig, device: torch.device, micro_batch: int = 0,
                 min_step_seconds: float = 0.0):
        self.model, self.run, self.device = model.to(device), run, device
        self.min_step_seconds = min_step_seconds
        # held for each step: with overlap, the background sync changes theta only between two steps
        self.step_lock = threading.Lock()
        self.params: List[torch.nn.Parameter] = list(self.model.parameters())
        self.micro_batch = micro_batch or run.batch_size
        self.optimizer = torch.optim.AdamW(
            self.params, lr=run.lr, betas=(0.9, 0.95), weight_decay=run.weight_decay,
            fused=device.type == "cuda",
        )
        self.local_steps = 0  # steps taken by this optimizer since it was created (drives warmup)
        self.autocast = device.type == "cuda"

    def lr_at(self, global_step: int) -> float:
        """Warmup on this peer's own fresh optimizer, cosine decay along the swarm's global step."""
        run = self.run
        warmup = min(1.0, (self.local_steps + 1) / run.warmup_steps) if run.warmup_steps else 1.0
        progress = min(1.0, global_step / max(run.lr_decay_steps, 1))
        cosine = run.min_lr_ratio + (1 - run.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return run.lr * warmup * cosine

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(self.device, non_blocking=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.model(input_ids=batch, labels=batch).loss

    def train(self, batches: Iterator[torch.Tensor], max_steps: int, global_step: int,
              should_stop: Callable[[int], bool] = lambda steps: False,
              on_step: Callable[[int, float, float], None] = lambda step, loss, lr: None) -> InnerStats:
        """Up to ``max_steps`` AdamW steps; ``should_stop(steps done)`` ends the round early."""
        self.model.train()
        stats, losses, start = InnerStats(), [], time.monotonic()
        while stats.steps < max_steps and not should_stop(stats.steps):
            step_start = time.monotonic()
            with self.step_lock:
                lr = self.lr_at(global_step + stats.steps)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                batch = next(batches)
                micro = batch.split(self.micro_batch)
                total = 0.0
                for chunk in micro:
                    loss = self._loss(chunk) / len(micro)
                    loss.backward()
                    total += loss.item()
                if self.run.grad_clip:
                    torch.nn.utils.clip_grad_norm_(self.params, self.run.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            time.sleep(max(0.0, step_start + self.min_step_seconds - time.monotonic()))
            self.local_steps += 1
            stats.steps += 1
            stats.tokens += batch.numel()
            stats.lr = lr
            losses.append(total)
            on_step(stats.steps, total, lr)
        stats.compute_seconds = time.monotonic() - start
        stats.loss = sum(losses) / len(losses) if losses else float("nan")
        return stats

    @torch.no_grad()
    def evaluate(self, batches: Iterable[torch.Tensor]) -> float:
        self.model.eval()
        losses = [self._loss(batch).item() for batch in batches]
        self.model.train()
        return sum(losses) / len(losses) if losses else float("nan")

    def first_moments(self) -> List[torch.Tensor]:
        """AdamW's exp_avg per parameter (zeros before its first step), for momentum alignment."""
        states = [self.optimizer.state.get(p, {}) for p in self.params]
        return [s["exp_avg"] if "exp_avg" in s else torch.zeros_like(p) for s, p in zip(states, self.params)]

    @torch.no_grad()
    def load_first_moments(self, moments: Sequence[torch.Tensor]) -> None:
        """Adopt the swarm's averaged first moment, clamped to what our own second moment can normalise.

        Adam keeps |m_hat| <= sqrt(v_hat) for its own moments, so no coordinate steps more than lr. An
        averaged m breaks that where this peer's v is ~0, e.g. embedding rows of tokens it has not seen
        yet, and an unclamped m / sqrt(v) there diverges the model within a few steps (measured: a fresh
        joiner's loss went from 3.1 to 61 in one round). The clamp restores the invariant.
        """
        beta1, beta2 = self.optimizer.param_groups[0]["betas"]
        for p, moment in zip(self.params, moments):
            state = self.optimizer.state.get(p, {})
            if "exp_avg" not in state:
                continue
            t = float(state["step"])
            bound = state["exp_avg_sq"].sqrt().mul_((1 - beta1**t) / math.sqrt(1 - beta2**t))
            aligned = moment.to(p.device, dtype=state["exp_avg"].dtype)
            clamped = torch.minimum(aligned, bound)
            state["exp_avg"].copy_(torch.maximum(clamped, bound.neg_()))
