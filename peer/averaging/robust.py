"""Robust aggregation of one part of the all-reduce, as each reducer runs it: pure tensors, no network.

A public run admits strangers, and one broken or hostile peer must not ruin the global state. Each
reducer, for each part, takes every sender's part and weight and:

1. rejects a part that holds NaN or Inf (its weight drops out), and leaves out a part of weight 0 (a member
   with no work this round: it takes the round's result and adds nothing, not even to the median);
2. computes a center, the coordinate-wise median of the remaining parts;
3. rejects a part whose deviation from the center is more than SEVERE times the clipping bound
   (``clip_factor`` times the median deviation norm): no honest peer, however stale, is that far off;
4. clips each remaining part's deviation to the bound (one step of CenteredClip, Karimireddy et al.
   2021, started at the median);
5. returns center + the weighted mean of the clipped deviations, over the weights of the parts kept.

When nobody is clipped this is the plain weighted mean (up to rounding), so honest groups lose nothing.
A part scaled by 1000 is dropped like a NaN one; a part a few times too large moves the result by at
most ``clip_factor`` honest deviations. Only a rejected part counts toward a ban: an honest stale peer's
larger delta may be clipped, but never gets it banned. Senders are summed
in index order, so the result does not depend on the order parts arrived in; and since the reducer
encodes its result once and sends the same bytes to every member, every member still ends identical.
With two senders the median is their mean and neither is clipped: two peers cannot tell who is wrong.
So when two parts differ in norm by more than PAIR_RATIO the reducer fails the round instead of averaging
them (measured: a peer sending 1000 x its pseudo-gradient, paired with one honest peer before the others
joined, poisoned the run in 1 of 3 runs of ``bench.robustness``), unless the smaller is all zeros (a peer with
no work). Nobody is blamed; in a group of 3 or more the median tells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

SEVERE = 10.0  # a deviation this many times the clipping bound is no honest straggler: rejected, counts toward a ban
PAIR_RATIO = SEVERE * SEVERE  # two parts this far apart in norm: one of them is not honest, nobody can tell which


@dataclass(frozen=True)
class Offence:
    sender: int
    reason: str  # "non-finite" | "rejected" (too far off) | "clipped"
    detail: str = ""
    severe: bool = True  # counts toward a ban; a mild clip (a stale peer's larger delta, say) does not


def robust_mean(parts: Dict[int, Tuple[torch.Tensor, float]], clip_factor: float
                ) -> Tuple[torch.Tensor, List[Offence]]:
    """The robust weighted mean of ``{sender: (part, weight)}``; ``clip_factor`` 0 turns clipping off.

    Raises ValueError when no part is usable (all non-finite, or every weight zero)."""
    offences: List[Offence] = []
    usable = {}
    for sender in sorted(parts):
        part, weight = parts[sender]
        if not torch.isfinite(part).all():
            offences.append(Offence(sender, "non-finite"))
        elif weight > 0:  # weight 0: a member with no work this round (it dropped its rounds past --max-staleness)
            usable[sender] = (part.to(torch.float32), float(weight))
    total = sum(weight for _, weight in usable.values())
    if not usable or total <= 0:
        raise ValueError("no sender's part is usable (every one non-finite or weightless)")
    if clip_factor > 0 and len(usable) == 2:
        small, large = sorted(part.norm().item() for part, _ in usable.values())
        # an all-zero part is a peer with no work (its rounds dropped past --max-staleness), no attack: averaged in,
        # it shrinks the step by its weight; taken for a part infinitely far off, it failed its pair's round
        if small > 0 and large > PAIR_RATIO * small:
            raise ValueError(f"the two senders' parts are {large / small:.3g} x apart in norm (more than "
                             f"{PAIR_RATIO:g}): with two, there is no telling which is wrong")
    if clip_factor <= 0 or len(usable) < 3:
        result = torch.zeros_like(next(iter(usable.values()))[0])
        for part, weight in usable.values():
            result.add_(part, alpha=weight)
        return result.div_(total), offences

    stacked = torch.stack([part for part, _ in usable.values()])
    # torch.quantile takes at most 2**24 values; median (the lower middle value) for larger parts
    center = stacked.quantile(0.5, dim=0) if stacked.numel() <= 2**24 else stacked.median(dim=0).values
    deviations = stacked - center
    norms = deviations.norm(dim=1)
    bound = clip_factor * norms.quantile(0.5).item()
    result, kept = torch.zeros_like(center), 0.0
    for row, (sender, (_, weight)) in enumerate(usable.items()):
        norm = norms[row].item()
        detail = f"deviation {norm:.3g} > {clip_factor:g} x median {bound / clip_factor:.3g}"
        if norm > SEVERE * bound:
            offences.append(Offence(sender, "rejected", detail.replace(">", f"> {SEVERE:g} x")))
            continue
        scale = 1.0 if norm <= bound or norm == 0 else bound / norm
        if scale < 1.0:
            offences.append(Offence(sender, "clipped", detail, severe=False))
        result.add_(deviations[row], alpha=weight * scale)
        kept += weight
    if kept <= 0:
        raise ValueError("no sender's part is usable (every one too far from the others)")
    return result.div_(kept).add_(center), offences
