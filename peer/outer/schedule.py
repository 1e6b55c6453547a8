"""Learning-rate schedules as plain functions of the global inner step (epoch x H).

The outer lr must be the same bits on every member of a group, so it is a function of the epoch alone, and
its cosine is computed with IEEE +, * and / only (``portable_cos``).
"""

from __future__ import annotations

import math
from typing import Callable


def portable_cos(x: float) -> float:
    """cos(x) for x in [0, pi] from IEEE double +, * and / alone (its Taylor series, to below 1e-15), so that
    every machine gets the same bits: libm's cos may differ in the last bit between platforms, and the outer
    lr must not (members apply the same outer step bit for bit)."""
    term, total, square = 1.0, 1.0, x * x
    for k in range(1, 24):
        term = -term * square / ((2 * k - 1) * (2 * k))
        total += term
    return total


def cosine_factor(global_step: int, decay_steps: int, min_ratio: float,
                  cos: Callable[[float], float] = math.cos) -> float:
    """Cosine decay at a global inner step: 1 at the start, ``min_ratio`` from ``decay_steps`` on."""
    progress = min(1.0, global_step / max(decay_steps, 1))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(math.pi * progress))
