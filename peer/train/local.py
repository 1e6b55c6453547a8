"""The local model theta as the sync phase sees it, with or without overlap (docs/design.md, step 8).

Without overlap the sync phase runs between two inner phases and reads and writes the live parameters.

With overlap, the sync of round e runs in the background while round e+1 trains. It must see theta_e,
the parameters at the end of round e (``freeze`` copies them, and AdamW's first moment, between two
steps), and every change it makes to theta must keep the steps taken since.

Round e+1 does not train on from theta_e: that point is a whole outer step behind the state the round's
work will be applied to, and DiLoCo's outer Nesterov (lr 0.7, momentum 0.9) moves G by up to about 7
rounds of local progress per step, so the round would compute its gradients far from where they land.
Instead, as in "eager updates" (Kale et al., 2025),
it starts from a proxy ``start``: the outer step this peer would take with its own pseudo-gradient in
place of the group's average. When the real outer step lands, setting theta to the new global state G'
becomes ``live += G' - start``, a shift applied between two inner steps under the trainer's step lock
(so does a rebase's shift): the work done since is kept, measured from G'. The pseudo-gradient of round
e+1 is that work; the error of the proxy is corrected the moment the average arrives.

With ``--fragments`` a round's outer step changes one fragment of G, so ``set`` and the eager start change that
fragment of theta only: the rest of the model trains on through the round (``peer/outer/fragments.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from peer.train.flat import FlatLayout
from peer.train.inner import InnerTrainer


class LocalModel:
    def __init__(self, trainer: InnerTrainer, layout: FlatLayout):
        self.trainer, self.layout = trainer, layout
        self.frozen: Optional[torch.Tensor] = None  # theta_e while its sync runs in the background
        self.frozen_moments: Optional[torch.Tensor] = None
        self.base: Optional[torch.Tensor] = None  # where the live model restarted from: theta_e, or ``start``

    def freeze(self, with_moments: bool) -> None:
        """Called between inner phases (no step running): the sync about to start sees this theta."""
        self.frozen = self.layout.gather(self.trainer.params, self.layout.empty())
        self.frozen_moments = (self.layout.gather(self.trainer.first_moments(), self.layout.empty())
                               if with_moments else None)
        self.base = self.frozen.clone()

    def start(self, proxy: torch.Tensor) -> None:
        """Between inner phases: the next round trains from ``proxy`` (the eager outer step) instead of theta_e."""
        self.layout.scatter(proxy, self.trainer.params)
        self.trainer.touch()
        self.base = proxy

    def thaw(self) -> None:
        """After the sync. If it took no outer step (it caught up, or found no group), the eager step the round
        started from was never corrected: take it back out (live += theta_e - start, both as shifted by any
        rebase), keeping the steps taken since. Left in, it would count this peer's work about 7 times over
        (Nesterov's momentum) in its next contribution (seen: the loss of 3 overlapped peers went 3.3 -> 150)."""
        if self.frozen is not None and not torch.equal(self.frozen, self.base):
            self._add_live(self.frozen - self.base)
        self.frozen = self.frozen_moments = self.base = None

    def settled(self, out: torch.Tensor) -> torch.Tensor:
        """The live parameters as ``thaw`` would leave them now: less the eager step if the sync took no outer step
        (a checkpoint between its end and ``thaw``)."""
        self.layout.gather(self.trainer.params, out)
        if self.frozen is not None:
            out.add_(self.frozen - self.base)
        return out

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        if self.frozen is None:
            return self.layout.gather(self.trainer.params, out)
        return out.copy_(self.frozen)

    def gather_moments(self, out: torch.Tensor) -> torch.Tensor:
        if self.frozen_moments is None:
            return self.layout.gather(self.trainer.first_moments(), out)
        return out.copy_(self.frozen_moments)

    def set(self, target: torch.Tensor, part: slice = slice(None)) -> None:
        """theta <- target; with overlap, live <- live + (target - base): the steps since are kept. ``part``: only
        that fragment of theta is set (a round of ``--fragments``); the rest keeps training untouched."""
        whole = part == slice(None)
        if self.frozen is None:
            if not whole:
                theta = self.layout.gather(self.trainer.params, self.layout.empty())
                theta[part] = target[part]
                target = theta
            self.layout.scatter(target, self.trainer.params)
            self.trainer.touch()
            return
        shift = target - self.base
        if not whole:
            shift[: part.start].zero_()
            shift[part.stop:].zero_()
        self._add_live(shift)
        self.frozen[part] = target[part]
        self.base[part] = target[part]

    def shift(self, shift: torch.Tensor) -> None:
        """theta <- theta + shift (a rebase onto a new lineage), on theta_e and on the live parameters."""
        self._add_live(shift)
        if self.frozen is not None:
            self.frozen.add_(shift)
            self.base.add_(shift)

    def _add_live(self, shift: torch.Tensor) -> None:
        """live += shift, between two inner steps."""
        with self.trainer.step_lock:
            self.layout.add_into(shift, self.trainer.params)
            self.trainer.touch()

    def load_first_moments(self, moments: torch.Tensor, part: slice = slice(None)) -> None:
        """AdamW's first moment <- the flat ``moments``; ``part``: only that fragment (of length ``moments``), the
        rest kept as it is now."""
        with self.trainer.step_lock:
            if part != slice(None):
                live = self.layout.gather(self.trainer.first_moments(), self.layout.empty())
                live[part] = moments
                moments = live
            self.trainer.load_first_moments([view for _, view in self.layout.slices(moments)])
            self.trainer.touch()
