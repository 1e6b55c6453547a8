"""Robust aggregation of one all-reduce part (pure tensors): NaN rejected, outliers clipped, honest unchanged."""

import pytest
import torch

from peer.robust import robust_mean


def honest(n, size=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=generator)
    return {i: (base + 0.1 * torch.randn(size, generator=generator), 100.0 + i) for i in range(n)}


def weighted_mean(parts):
    total = sum(w for _, w in parts.values())
    return sum(p * w for p, w in parts.values()) / total


def test_an_honest_group_gets_its_weighted_mean():
    parts = honest(4)
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert offences == []
    assert torch.allclose(result, weighted_mean(parts), atol=1e-5)


def test_non_finite_parts_are_rejected_and_named():
    parts = honest(4)
    clean = dict(parts)
    parts[4] = (torch.full((1000,), float("nan")), 100.0)
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert [(o.sender, o.reason) for o in offences] == [(4, "non-finite")]
    assert torch.allclose(result, weighted_mean(clean), atol=1e-5)


def test_a_part_scaled_by_1000_moves_the_mean_by_little():
    parts = honest(4)
    clean = weighted_mean(dict(parts))
    parts[3] = (parts[3][0] * 1000, parts[3][1])
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert [(o.sender, o.reason) for o in offences] == [(3, "clipped")]
    plain = weighted_mean(parts)
    assert (plain - clean).norm() > 100 * clean.norm()  # what a plain average would have done
    assert (result - clean).norm() < 0.2 * clean.norm()


def test_order_of_arrival_does_not_matter_and_two_senders_are_never_clipped():
    parts = honest(5)
    forward, _ = robust_mean(parts, clip_factor=2.0)
    backward, _ = robust_mean(dict(reversed(list(parts.items()))), clip_factor=2.0)
    assert torch.equal(forward, backward)
    pair = {0: (torch.zeros(10), 1.0), 1: (torch.full((10,), 1000.0), 1.0)}
    result, offences = robust_mean(pair, clip_factor=2.0)
    assert offences == [] and torch.equal(result, torch.full((10,), 500.0))


def test_nothing_usable_is_an_error():
    with pytest.raises(ValueError, match="no sender's part is usable"):
        robust_mean({0: (torch.tensor([float("inf")]), 1.0)}, clip_factor=2.0)
