"""The inner optimizer: torch's AdamW, called eagerly, so that a restart never imports ``torch._dynamo``.

torch.optim guards its methods against tracing by ``torch.compile``: ``add_param_group``, ``load_state_dict``,
``state_dict`` and ``zero_grad`` are wrapped in ``torch._disable_dynamo``, and ``step`` in a wrapper that sets the
grad mode and marks graph breaks. Each wrapper imports ``torch._dynamo`` on its first call: about 1.1 s of a 3.3-s
restart on this machine (bench/results/startup.md), spent before the first inner step, because the optimizer is
built and its state restored first. Our optimizer is never traced (``--compile`` compiles the model, and the steps
call the optimizer outside it), so those guards do nothing for us: ``EagerAdamW`` calls the methods they wrap
(``__wrapped__``), with the grad mode ``step``'s wrapper sets. The arithmetic is torch's own, bit for bit
(tests/test_optim.py). A torch without ``__wrapped__`` on a method gets the wrapped method, as before.
"""

from __future__ import annotations

import torch
from torch.optim import AdamW, Optimizer


def _unguarded(method):
    return getattr(method, "__wrapped__", method)


class EagerAdamW(AdamW):
    def add_param_group(self, param_group: dict) -> None:
        _unguarded(Optimizer.add_param_group)(self, param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        _unguarded(Optimizer.load_state_dict)(self, state_dict)

    def state_dict(self) -> dict:
        return _unguarded(Optimizer.state_dict)(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _unguarded(Optimizer.zero_grad)(self, set_to_none)

    @torch.no_grad()  # what step's wrapper sets for a non-differentiable optimizer (``defaults["differentiable"]``)
    def step(self, closure=None):
        return _unguarded(AdamW.step)(self, closure)
