"""The local model theta as the sync phase sees it, with or without overlap (DESIGN.md step 8).

Without overlap the sync phase runs between two inner phases and reads and writes the live parameters.

With overlap, the sync of round e runs in the background while round e+1 trains. It must see theta_e,
the parameters at the end of round e (``freeze`` copies them, and AdamW's first moment, between two
steps), and every change it makes to theta must keep the steps taken since: setting theta to a new
global state G' (after the outer step, or a rebase) becomes ``live += G' - theta_e``, a shift applied
between two inner steps under the trainer's step lock; so does a rebase's shift. The pseudo-gradient
of round e+1 is then exactly the work done since theta_e, measured from G' (the outer update lands one
round late, as in Streaming DiLoCo).
"""

from __future__ import annotations

from typing import Optional

import torch

from peer.flat import FlatLayout
from peer.inner import InnerTrainer


class LocalModel:
    def __init__(self, trainer: InnerTrainer, layout: FlatLayout):
        self.trainer, self.layout = trainer, layout
        self.frozen: Optional[torch.Tensor] = None  # theta_e while its sync runs in the background
        self.frozen_moments: Optional[torch.Tensor] = None

    def freeze(self, with_moments: bool) -> None:
        """Called between inner phases (no step running): the sync about to start sees this theta."""
        self.frozen = self.layout.gather(self.trainer.params, self.layout.empty())
        self.frozen_moments = (self.layout.gather(self.trainer.first_moments(), self.layout.empty())
                               if with_moments else None)

    def thaw(self) -> None:
        self.frozen = self.frozen_moments = None

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        if self.frozen is None:
            return self.layout.gather(self.trainer.params, out)
        return out.copy_(self.frozen)

    def gather_moments(self, out: torch.Tensor) -> torch.Tensor:
        if self.frozen_moments is None:
            return self.layout.gather(self.trainer.first_moments(), out)
        return out.copy_(self.frozen_moments)

    def set(self, target: torch.Tensor) -> None:
        """theta <- target; with overlap, live <- live + (target - theta_e): the steps since are kept."""
        if self.frozen is None:
            self.layout.scatter(target, self.trainer.params)
            return
        shift = target - self.frozen
        with self.trainer.step_lock:
            self.layout.add_into(shift, self.trainer.params)
        self.frozen.copy_(target)

    def shift(self, shift: torch.Tensor) -> None:
        """theta <- theta + shift (a rebase onto a new lineage), on theta_e and on the live parameters."""
        with self.trainer.step_lock:
            self.layout.add_into(shift, self.trainer.params)
        if self.frozen is not None:
            self.frozen.add_(shift)

    def load_first_moments(self, moments) -> None:
        with self.trainer.step_lock:
            self.trainer.load_first_moments(moments)
