"""The outer optimizer: Nesterov SGD on the averaged pseudo-gradient, on CPU fp32 tensors.

Bit-identical results on every group member need every member to run the same IEEE operations in
the same order. Each operation here is a single rounded op (mul, add, sub); none is a fused
multiply-add (``add_(x, alpha=a)`` may compile to FMA on one CPU and not on another). It all runs on
the CPU in fp32, in chunks so memory stays at one chunk beyond the state itself.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 22  # values per chunk of the outer step: 16 MiB of temporaries at most


@torch.no_grad()
def nesterov_step(params: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float) -> None:
    """Outer Nesterov SGD on the averaged pseudo-gradient, in place (DiLoCo, arXiv 2311.08105):

        m <- mu * m + delta
        G <- G - lr * (delta + mu * m)

    the same update as torch.optim.SGD(nesterov=True), written without fused ops.
    """
    for start in range(0, params.numel(), CHUNK):
        g, m, d = (t[start : start + CHUNK] for t in (params, momentum, delta))
        m.mul_(mu).add_(d)
        update = torch.mul(m, mu)
        update.add_(d)
        update.mul_(lr)
        g.sub_(update)
