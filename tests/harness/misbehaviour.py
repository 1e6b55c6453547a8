"""A byzantine peer for tests and benchmarks: what it sends instead of its real pseudo-gradient.

- ``nan``: every value NaN (reducers must reject the part);
- ``scale:FACTOR``: FACTOR times the real pseudo-gradient (reducers must clip or reject it).
"""

from __future__ import annotations

import re
from typing import Optional

import torch


class Misbehaviour:
    def __init__(self, kind: str):
        if kind != "nan" and not re.fullmatch(r"scale:[-+0-9.eE]+", kind):
            raise ValueError(f"byzantine must be 'nan' or 'scale:FACTOR', got {kind!r}")
        self.kind = kind

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["Misbehaviour"]:
        return cls(text) if text else None

    def apply(self, delta: torch.Tensor) -> None:
        if self.kind == "nan":
            delta.fill_(float("nan"))
        else:
            delta.mul_(float(self.kind.split(":")[1]))
