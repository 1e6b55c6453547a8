"""The outer step and the state hash: plain functions, no network."""

import pytest
import torch

import peer.outer.nesterov as nesterov
import peer.outer.state as outer
from peer.outer.nesterov import nesterov_step
from peer.outer.state import GlobalState, merge_contributors, state_hash


def random_state(n=10_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2)


def test_nesterov_matches_torch_sgd():
    params, momentum, delta = random_state()
    reference = torch.nn.Parameter(params.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    sgd.state[reference]["momentum_buffer"] = momentum.clone()
    reference.grad = delta.clone()
    sgd.step()
    nesterov_step(params, momentum, delta, lr=0.7, mu=0.9)
    torch.testing.assert_close(params, reference.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(momentum, sgd.state[reference]["momentum_buffer"], rtol=0, atol=0)


def test_outer_step_is_bit_identical_and_chunk_independent(monkeypatch):
    a = random_state(seed=1)
    b = tuple(t.clone() for t in a)
    nesterov_step(*a, lr=0.7, mu=0.9)
    monkeypatch.setattr(nesterov, "CHUNK", 333)  # chunk edges must not change a single bit
    nesterov_step(*b, lr=0.7, mu=0.9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert state_hash(a[0], a[1], 3) == state_hash(b[0], b[1], 3)


def test_state_hash_covers_params_momentum_and_epoch():
    params, momentum, _ = random_state()
    base = state_hash(params, momentum, 5)
    assert base == GlobalState(params.clone(), momentum.clone(), epoch=5).hash()
    assert state_hash(params, momentum, 6) != base
    flipped = params.clone()
    flipped.view(torch.int32)[17] ^= 1  # the last bit of one value
    assert state_hash(flipped, momentum, 5) != base
    assert state_hash(params, momentum + 0.0, 5) == base
    assert state_hash(params, momentum * 1.0000001, 5) != base


def test_a_cached_hash_follows_every_way_the_state_changes(monkeypatch):
    params, momentum, delta = random_state()
    state = GlobalState(params, momentum, epoch=5)
    computed = []
    monkeypatch.setattr(outer, "state_hash", lambda *args: computed.append(1) or state_hash(*args))
    first = state.hash()
    assert state.hash() == first and len(computed) == 1  # unchanged: not hashed again

    def expect_new(why):
        fresh = state_hash(state.params, state.momentum, state.epoch)
        assert state.hash() == fresh, why

    nesterov_step(state.params, state.momentum, delta, lr=0.7, mu=0.9)  # in place, through chunk views
    expect_new("an outer step")
    state.params[3:4].copy_(torch.tensor([1.5]))  # a write through a view
    expect_new("a write through a view")
    state.momentum.copy_(torch.zeros_like(state.momentum))  # as a restored checkpoint does
    expect_new("a copy into m")
    state.params = state.params.clone()  # a new tensor, equal values: the hash must still be right
    state.params.view(torch.int32)[0] ^= 1
    expect_new("a new tensor")
    state.epoch += 1
    expect_new("a new epoch")
    assert len(computed) == 6  # once per change, never more


def test_state_hash_rejects_non_contiguous_or_wrong_dtype():
    params, momentum, _ = random_state()
    with pytest.raises(ValueError):
        state_hash(params[::2], momentum[::2], 0)
    with pytest.raises(ValueError):
        state_hash(params.double(), momentum.double(), 0)


def test_merge_contributors_keeps_the_newest():
    merged = merge_contributors({}, ["a", "b"], epoch=0)
    merged = merge_contributors(merged, ["a"], epoch=1)
    assert merged == {"a": 1, "b": 0}
    many = merge_contributors({}, [f"p{i}" for i in range(outer.MERGED_HISTORY + 44)], epoch=0)
    many = merge_contributors(many, ["new"], epoch=1)
    assert len(many) == outer.MERGED_HISTORY and many["new"] == 1
