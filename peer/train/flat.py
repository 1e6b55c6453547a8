"""One flat fp32 CPU vector per model-sized quantity (G, m, the pseudo-gradient, the first moment).

The outer state lives in CPU memory in fp32 whatever the training device, as in prime: an accelerator
holds only the model and its AdamW state. Copies between a GPU model and these vectors go through one
pinned staging vector, so they run as fast DMA transfers instead of pageable copies.
"""

from __future__ import annotations

import threading
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


class FlatLayout:
    """Where each parameter lives in a flat vector, in ``model.parameters()`` order."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.numel = sum(self.numels)
        self._staging: Optional[torch.Tensor] = None  # pinned, made on the first copy to or from a GPU
        self._staging_lock = threading.Lock()

    def slices(self, flat: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
        offset = 0
        for index, (numel, shape) in enumerate(zip(self.numels, self.shapes)):
            yield index, flat[offset : offset + numel].view(shape)
            offset += numel

    def empty(self, shared: bool = False) -> torch.Tensor:
        flat = torch.zeros(self.numel, dtype=torch.float32)
        return flat.share_memory_() if shared else flat

    def _pinned(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
        return self._staging

    @torch.no_grad()
    def gather(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy ``tensors`` (any device, any float dtype) into the flat fp32 CPU vector ``out``."""
        if not tensors or not tensors[0].is_cuda:
            for index, view in self.slices(out):
                view.copy_(tensors[index].detach())
            return out
        with self._staging_lock:
            staging = self._pinned()
            for index, view in self.slices(staging):
                view.copy_(tensors[index].detach(), non_blocking=True)
            torch.cuda.current_stream(tensors[0].device).synchronize()
            return out.copy_(staging)

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the flat vector back into ``tensors`` (on their own devices)."""
        self._into(flat, tensors, torch.Tensor.copy_)

    @torch.no_grad()
    def add_into(self, flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
        """tensors += flat, slice by slice (used to rebase the inner model onto a new global state)."""
        self._into(flat, tensors, torch.Tensor.add_)

    def _into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], op) -> None:
        if not tensors or not tensors[0].is_cuda:
            for index, view in self.slices(flat):
                op(tensors[index], view)
            return
        with self._staging_lock:
            staging = self._pinned().copy_(flat)
            for index, view in self.slices(staging):
                op(tensors[index], view.to(tensors[index].device, non_blocking=True))
            torch.cuda.current_stream(tensors[0].device).synchronize()  # before the staging vector is reused
