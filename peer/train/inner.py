"""The inner loop: AdamW on the local model, with warmup and cosine decay, clipping and accumulation.

Like nanoGPT's loop, but bounded by a step budget and a wall-clock deadline, so a round ends after H
steps or when the swarm's schedule says so. On CUDA it runs under bf16 autocast with fused AdamW, and
optionally compiled (``--compile``). In an island (peer/train/island.py) the model is wrapped in
DistributedDataParallel and rank 0 tells the other ranks before each step what to do.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence

import torch

from peer.config import RunConfig
from peer.train.optim import EagerAdamW


@dataclass
class InnerStats:
    steps: int = 0
    tokens: int = 0
    loss: float = float("nan")  # mean training loss over the round's steps
    compute_seconds: float = 0.0
    lr: float = 0.0
    rank_tokens: Optional[List[int]] = None  # in an island: each rank's tokens (``tokens`` is their sum)


def batch_loss(model: torch.nn.Module, batch: torch.Tensor, device: torch.device, autocast: bool) -> torch.Tensor:
    """The causal-LM loss of ``batch`` (bf16 autocast where ``autocast``: on CUDA)."""
    batch = batch.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=batch, labels=batch).loss


@torch.no_grad()
def mean_loss(module: torch.nn.Module, batches: Iterable[torch.Tensor], device: torch.device = torch.device("cpu"),
              autocast: bool = False) -> float:
    """Mean loss on ``batches`` in eval mode: a peer's ``eval_loss``, and the benchmarks' baselines' too."""
    module.eval()
    losses = [batch_loss(module, batch, device, autocast).item() for batch in batches]
    module.train()
    return sum(losses) / len(losses) if losses else float("nan")


class InnerTrainer:
    def __init__(self, model: torch.nn.Module, run: RunConfig, device: torch.device, micro_batch: int = 0,
                 min_step_seconds: float = 0.0, island=None, compile: bool = False):
        self.module, self.run, self.device = model.to(device), run, device
        self.min_step_seconds, self.island = min_step_seconds, island
        # held for each step: with overlap, the background sync changes theta only between two steps
        self.step_lock = threading.Lock()
        self.params: List[torch.nn.Parameter] = list(self.module.parameters())
        self.model = self.module  # what the training steps call: compiled, and DDP-wrapped in an island
        if compile:
            self.model = torch.compile(self.model)
        if island is not None:
            from torch.nn.parallel import DistributedDataParallel

            with island.guard():  # DDP's construction broadcasts rank 0's weights: a collective
                self.model = DistributedDataParallel(self.model, device_ids=[device] if device.type == "cuda" else None)
        # theta or AdamW's state was changed from outside the steps (by the swarm): an island's rank 0 then
        # sends its model to the other ranks before the next step
        self.changed = True
        self.micro_batch = micro_batch or run.batch_size
        self.optimizer = EagerAdamW(
            self.params, lr=run.lr, betas=(0.9, 0.95), weight_decay=run.weight_decay,
            fused=device.type == "cuda",
        )
        self.local_steps = 0  # steps taken by this optimizer since it was created (drives warmup)
        self.autocast = device.type == "cuda"

    def lr_at(self, global_step: int) -> float:
        """Warmup on this peer's own fresh optimizer, cosine decay along the swarm's global step."""
        run = self.run
        warmup = min(1.0, (self.local_steps + 1) / run.warmup_steps) if run.warmup_steps else 1.0
        return run.lr * warmup * run.lr_factor(global_step)

    def _loss(self, batch: torch.Tensor, model: Optional[torch.nn.Module] = None) -> torch.Tensor:
        return batch_loss(model or self.model, batch, self.device, self.autocast)

    def touch(self) -> None:
        """Someone other than the inner steps changed theta or the optimizer's state."""
        self.changed = True

    def step(self, batch: torch.Tensor, lr: float) -> float:
        """One AdamW step on ``batch`` (accumulated over micro-batches); returns its mean loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        micro = batch.split(self.micro_batch)
        total = 0.0
        for index, chunk in enumerate(micro):
            # in an island, DDP averages the gradients once, on the last micro-batch's backward
            last = index == len(micro) - 1
            with self.model.no_sync() if self.island is not None and not last else contextlib.nullcontext():
                loss = self._loss(chunk) / len(micro)
                loss.backward()
            total += loss.item()
        if self.run.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.run.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

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
                batch = next(batches)
                if self.island is None:
                    total = self.step(batch, lr)
                else:
                    self.island.before_step(self, lr)
                    with self.island.guard():
                        total = self.step(batch, lr)
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

    def evaluate(self, batches: Iterable[torch.Tensor]) -> float:
        """Mean loss on ``batches``, on this process alone (the plain module: no island collective)."""
        return mean_loss(self.module, batches, self.device, self.autocast)

    def peak_memory(self) -> int:
        """Peak bytes so far: allocated on the GPU we train on, or this process's peak RSS on a CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB

    def adam_step(self) -> Optional[float]:
        """AdamW's step count, or None before its first step."""
        state = self.optimizer.state.get(self.params[0], {})
        return float(state["step"]) if "step" in state else None

    def adam_state(self, param: torch.nn.Parameter, step: float) -> dict:
        """AdamW's state of ``param``, created (zeros at ``step``) on a rank that has not stepped yet."""
        state = self.optimizer.state[param]
        if "exp_avg" not in state:
            fused = bool(self.optimizer.param_groups[0].get("fused"))
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=param.device if fused else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"].fill_(step)
        return state

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
