"""Adopting a downloaded state: hash check and rebasing, with no network (pure tensor bookkeeping)."""

import torch

from peer.outer.lineage import Rebase, rebase_kind
from peer.outer.state import state_hash
from tests.harness.fake import FakePeer


def make(theta_values, g_values):
    peer = FakePeer(numel=4)
    with torch.no_grad():
        peer.params[0].copy_(torch.tensor(theta_values[:2]))
        peer.params[1].copy_(torch.tensor(theta_values[2:]))
    peer.state.params = torch.tensor(g_values)
    peer.state.tokens_total = 100
    return peer


def offer(g_new, epoch=6, merged=None):
    g_new, m_new = torch.tensor(g_new), torch.ones(len(g_new))
    metadata = dict(epoch=epoch, tokens_total=500, merged=merged or {}, hash=state_hash(g_new, m_new, epoch))
    return metadata, [g_new, m_new]


def own_delta(peer):
    return peer.lineage.own_delta(peer.state.params, peer.theta)


def test_rebase_keeps_unmerged_work():
    peer = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])  # our delta G - theta = 0.5 each
    assert peer.catchup.adopt(*offer([10.0, 20.0, 30.0, 40.0])) is Rebase.KEEP_WORK
    assert torch.equal(peer.theta, torch.tensor([9.5, 19.5, 29.5, 39.5]))
    assert peer.state.epoch == 6 and peer.state.tokens_total == 500 and peer.hash() == state_hash(
        torch.tensor([10.0, 20.0, 30.0, 40.0]), torch.ones(4), 6)


def test_work_merged_only_in_a_losing_fork_is_carried():
    peer = make([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    contributions = peer.lineage.contributions
    contributions.remember(4, torch.full((4,), 0.125), tokens=30)  # merged at epochs 4 and 5 in our
    contributions.remember(5, torch.full((4,), 0.25), tokens=70)  # (losing) lineage
    assert peer.catchup.adopt(*offer([2.0, 2.0, 2.0, 2.0], merged={"me": 3}))
    # the local model rebases as usual (theta <- G_new - (G - theta)); the lost deltas ride on our next delta
    assert torch.equal(peer.theta, torch.full((4,), 2.0))
    assert torch.equal(own_delta(peer), torch.full((4,), 0.375))
    assert peer.lineage.take_recovered_tokens() == 100 and peer.lineage.take_recovered_tokens() == 0
    contributions.remember(4, torch.full((4,), 0.125), tokens=30)
    contributions.remember(5, torch.full((4,), 0.25), tokens=70)  # the winner merged 5: nothing to carry
    assert peer.catchup.adopt(*offer([3.0, 3.0, 3.0, 3.0], epoch=7, merged={"me": 5}))
    assert torch.equal(peer.theta, torch.full((4,), 3.0)) and peer.lineage.take_recovered_tokens() == 0
    assert torch.equal(own_delta(peer), torch.full((4,), 0.375))  # what was carried before is still unsent


def test_a_group_that_merged_our_attempt_is_not_counted_twice():
    peer = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])
    kind = peer.catchup.adopt(*offer([10.0, 20.0, 30.0, 40.0], epoch=5, merged={"me": 4}), attempted_epoch=4)
    assert kind is Rebase.OURS_MERGED and torch.equal(peer.theta, torch.tensor([10.0, 20.0, 30.0, 40.0]))


def test_a_state_that_fails_its_hash_is_rejected():
    peer = make([1.0, 2.0, 3.0, 4.0], [1.5, 2.5, 3.5, 4.5])
    metadata, tensors = offer([10.0, 20.0, 30.0, 40.0])
    tensors[0][0] += 1e-3
    assert peer.catchup.adopt(metadata, tensors) is None
    assert torch.equal(peer.theta, torch.tensor([1.0, 2.0, 3.0, 4.0])) and peer.state.epoch == 4
    assert peer.catchup.adopt({"epoch": "x"}, tensors) is None and peer.catchup.adopt(metadata, tensors[:1]) is None


def test_which_rebase():
    assert rebase_kind(our_last_merged=4, attempted_epoch=4, resumed_epoch=None) is Rebase.OURS_MERGED
    assert rebase_kind(our_last_merged=3, attempted_epoch=4, resumed_epoch=None) is Rebase.KEEP_WORK
    assert rebase_kind(our_last_merged=4, attempted_epoch=None, resumed_epoch=4) is Rebase.RESUMED_MERGED
    assert rebase_kind(our_last_merged=3, attempted_epoch=None, resumed_epoch=4) is Rebase.KEEP_WORK
    assert rebase_kind(our_last_merged=-1, attempted_epoch=None, resumed_epoch=None) is Rebase.KEEP_WORK
