"""Streaming fragments: which part of the flat model vector a round averages (Streaming DiLoCo, arXiv 2501.18512).

With ``--fragments F`` the flat vector of ``n`` values is cut into F contiguous fragments of ``ceil(n / F)`` values
(the last one shorter), and a round is H / F inner steps. Round ``e`` averages fragment ``e mod F`` only, so each
fragment is averaged every H steps, and the fragments' syncs are staggered by H / F steps: every round sends 1/F
of the model, and the bytes in flight at any moment are cut by F at the same bytes per H steps. The rest of the
model keeps training through the round untouched: a fragment's pseudo-gradient is the work of the H steps since
it was last averaged.

The epoch still counts rounds, and ``hash(G, m, e)`` still names one global state per epoch: G and m are whole,
and a round's outer step changes one fragment of them. With F = 1 the single fragment is the whole vector, and a
round is what it always was.

Contiguous cuts of the flat vector (rather than the paper's strided transformer blocks) give every round the same
bytes to send; the outer step is elementwise, so how the vector is cut does not change its math.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fragments:
    numel: int  # values in the flat vector
    count: int  # F

    def __post_init__(self):
        if self.count < 1 or self.count > max(self.numel, 1):
            raise ValueError(f"fragments must be in [1, {self.numel}], got {self.count}")

    @property
    def size(self) -> int:
        """Values in the largest fragment: the size of the averaged buffers (a shorter last fragment is padded
        with zeros there, which average to zero and are never applied)."""
        return -(-self.numel // self.count)

    def of(self, epoch: int) -> slice:
        """The fragment that the round closing ``epoch`` averages."""
        index = epoch % self.count
        return slice(index * self.size, min(self.numel, (index + 1) * self.size))

    def whole(self) -> bool:
        return self.count == 1
