"""Adopting a downloaded state: hash check and rebasing, with no network (pure tensor bookkeeping)."""

import threading
from types import SimpleNamespace

import torch

from peer.config import RunConfig, SyncConfig
from peer.outer.state import GlobalState, state_hash
from peer.round.sync import Synchronizer
from peer.train.flat import FlatLayout


def make(theta_values, g_values):
    params = [torch.nn.Parameter(torch.tensor(theta_values[:2])), torch.nn.Parameter(torch.tensor(theta_values[2:]))]
    layout = FlatLayout(params)
    state = GlobalState(torch.tensor(g_values), torch.zeros(len(g_values)), epoch=4, tokens_total=100)
    sync = Synchronizer(averager=None, dht=None, run_id="r", manifest_hash="m", peer_id="me", state=state,
                        trainer=SimpleNamespace(params=params, step_lock=threading.Lock(), touch=lambda: None),
                        layout=layout,
                        run=RunConfig().resolved(),
                        sync=SyncConfig(), delta=layout.empty(), moment=None, lock=threading.Lock(),
                        client_mode=False)
    return sync, params


def theta(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def offer(g_new, epoch=6, merged=None):
    g_new, m_new = torch.tensor(g_new), torch.ones(len(g_new))
    metadata = dict(epoch=epoch, tokens_total=500, merged=merged or {}, hash=state_hash(g_new, m_new, epoch))
    return metadata, [g_new, m_new]


def test_rebase_keeps_unmerged_work():
    sync, params = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])  # our delta G - theta = 0.5 each
    assert sync.adopt(*offer([10.0, 20.0, 30.0, 40.0]))
    assert torch.equal(theta(params), torch.tensor([9.5, 19.5, 29.5, 39.5]))
    assert sync.state.epoch == 6 and sync.state.tokens_total == 500 and sync.state.hash() == state_hash(
        torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.ones(4), 6)


def test_work_merged_only_in_a_losing_fork_is_carried():
    sync, params = make([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    sync.contributions.remember(4, torch.full((4,), 0.125), tokens=30)  # merged at epochs 4 and 5 in our
    sync.contributions.remember(5, torch.full((4,), 0.25), tokens=70)  # (losing) lineage
    assert sync.adopt(*offer([2.0, 2.0, 2.0, 2.0], merged={"me": 3}))
    # the local model rebases as usual (theta <- G_new - (G - theta)); the lost deltas ride on our next delta
    assert torch.equal(theta(params), torch.full((4,), 2.0))
    assert torch.equal(sync._own_delta(), torch.full((4,), 0.375))
    assert sync.take_recovered_tokens() == 100 and sync.take_recovered_tokens() == 0  # and their tokens count
    sync.contributions.remember(4, torch.full((4,), 0.125), tokens=30)
    sync.contributions.remember(5, torch.full((4,), 0.25), tokens=70)  # the winner merged 5: nothing to carry
    assert sync.adopt(*offer([3.0, 3.0, 3.0, 3.0], epoch=7, merged={"me": 5}))
    assert torch.equal(theta(params), torch.full((4,), 3.0)) and sync.take_recovered_tokens() == 0
    assert torch.equal(sync._own_delta(), torch.full((4,), 0.375))  # what was carried before is still unsent


def test_a_group_that_merged_our_attempt_is_not_counted_twice():
    sync, params = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])
    assert sync.adopt(*offer([10.0, 20.0, 30.0, 40.0], epoch=5, merged={"me": 4}), attempted_epoch=4)
    assert sync.merged_ours and torch.equal(theta(params), torch.tensor([10.0, 20.0, 30.0, 40.0]))


def test_a_state_that_fails_its_hash_is_rejected():
    sync, params = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])
    metadata, tensors = offer([10.0, 20.0, 30.0, 40.0])
    tensors[0][0] += 1e-3
    assert not sync.adopt(metadata, tensors)
    assert torch.equal(theta(params), torch.tensor([1.0, 2.0, 3.0, 4.0])) and sync.state.epoch == 4
    assert not sync.adopt({"epoch": "x"}, tensors) and not sync.adopt(metadata, tensors[:1])
