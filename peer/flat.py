"""One flat fp32 CPU vector per model-sized quantity (G, m, the pseudo-gradient, the first moment)."""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import torch


class FlatLayout:
    """Where each parameter lives in a flat vector, in ``model.parameters()`` order."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)

    def slices(self, flat: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
        offset = 0
        for index, (numel, shape) in enumerate(zip(self.numels, self.shapes)):
            yield index, flat[offset : offset + numel].view(shape)
            offset += numel

    def empty(self, shared: bool = False) -> torch.Tensor:
        flat = torch.zeros(self.numel, dtype=torch.float32)
        return flat.share_memory_() if shared else flat

    @torch.no_grad()
    def gather(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy ``tensors`` (any device, any float dtype) into the flat fp32 CPU vector ``out``."""
        for index, view in self.slices(out):
            view.copy_(tensors[index].detach())
        return out

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the flat vector back into ``tensors`` (on their own devices)."""
        for index, view in self.slices(flat):
            tensors[index].copy_(view)

    @torch.no_grad()
    def add_into(self, flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
        """tensors += flat, slice by slice (used to rebase the inner model onto a new global state)."""
        for index, view in self.slices(flat):
            tensors[index].add_(view.to(tensors[index].device))
