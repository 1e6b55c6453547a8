"""A peer's own recent contributions, kept so that work merged only in a losing fork is not lost.

When two groups fork the state (a partition, a split matchmaking), the fork choice picks one lineage
and the peers of the other rebase onto it (docs/design.md, step 7). Their deltas were merged only in the
lineage they leave, so each peer carries its own unmerged deltas, and the tokens behind them, into its
next contribution: added to the pseudo-gradient it sends, not to its local model, which rebases onto
the winner as docs/design.md, step 6, says (theta <- G_new - its current delta). Deltas are kept as the wire
codec encoded them (what the peer sent): two bytes per parameter with fp16, about half a byte with
int4; at most ``keep`` of them (--max-staleness). With fragments, a delta is the fragment that round averaged, kept
with its offset in the flat vector.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, List, Tuple

import torch
from diloco_compression import Codec
from diloco_compression.feedback import CHUNK_VALUES


class Contributions:
    def __init__(self, codec: Codec, keep: int):
        self.codec = codec
        self.items: Deque[Tuple[int, slice, List[bytes], int]] = deque(maxlen=max(keep, 1))

    def remember(self, epoch: int, delta: torch.Tensor, tokens: int, offset: int = 0) -> None:
        """Our ``delta`` (as sent) was merged into the outer step taken at ``epoch``; it covers the flat vector from
        ``offset`` on."""
        chunks = [self.codec.encode(delta[start: start + CHUNK_VALUES])
                  for start in range(0, delta.numel(), CHUNK_VALUES)]
        self.items.append((epoch, slice(offset, offset + delta.numel()), chunks, tokens))

    def unmerged(self, merged_epoch: int) -> bool:
        """Do we hold deltas merged after ``merged_epoch`` (the last epoch at which the lineage we move to
        merged one of ours)?"""
        return any(epoch > merged_epoch for epoch, _, _, _ in self.items)

    def carry_into(self, total: torch.Tensor, merged_epoch: int) -> int:
        """Add to ``total`` our deltas merged after ``merged_epoch``; returns the tokens behind them."""
        tokens = 0
        for epoch, part, chunks, count in self.items:
            if epoch > merged_epoch:
                for index, chunk in enumerate(chunks):
                    piece = total[part][index * CHUNK_VALUES: (index + 1) * CHUNK_VALUES]
                    piece.add_(self.codec.decode(chunk, piece.numel()))
                tokens += count
        return tokens

    def clear(self) -> None:
        self.items.clear()
