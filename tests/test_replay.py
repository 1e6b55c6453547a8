"""Catching up by replaying the rounds missed (peer/round/catchup.py): a peer a few rounds behind takes each round's
result from a peer that holds it and steps itself, instead of downloading the whole state; in-process."""

import torch

from peer.config import RunConfig
from peer.outer.fragments import Fragments
from peer.outer.nesterov import nesterov_step
from peer.outer.state import merge_contributors, state_hash
from peer.swarm.metadata import Averaged, Contribution
from tests.harness.fake import FakePeer, record

FOUR = RunConfig(align_every=0, inner_steps=8, fragments=4).resolved()


def swarm_rounds(peer, averages, members=("a", "b")):
    """The rounds the swarm took from the peer's state, each with one of ``averages`` as its result: served by
    "a" and "b", who hold the last state. Returns that state's hash and its (G, m, e, tokens, merged)."""
    run, fragments = peer.run, Fragments(peer.layout.numel, peer.run.fragments)
    params, momentum = peer.state.params.clone(), peer.state.momentum.clone()
    epoch, tokens, merged = peer.state.epoch, peer.state.tokens_total, dict(peer.state.merged)
    for average in averages:
        gathered = {m: Contribution(epoch=epoch, hash=state_hash(params, momentum, epoch), tokens=100) for m in members}
        peer.transport.results[(epoch, state_hash(params, momentum, epoch))] = (
            Averaged(gathered=gathered, aligned=False, seconds=1.0), average)
        part, step = fragments.of(epoch), run.global_step(epoch)
        nesterov_step(params[part], momentum[part], average, run.outer_lr_at(step), run.outer_momentum_at(step))
        merged = merge_contributors(merged, gathered, epoch)
        epoch, tokens = epoch + 1, tokens + 100 * len(members)
    digest = state_hash(params, momentum, epoch)
    for member in members:
        peer.transport.peers[member] = record(member, epoch, digest, tokens)
    return digest, (params, momentum, epoch, tokens, merged)


def test_a_peer_two_rounds_behind_replays_them_to_the_swarms_hash_without_a_download():
    peer = FakePeer(numel=8, run=FOUR)
    delta = peer.train()
    digest, (params, momentum, epoch, tokens, merged) = swarm_rounds(
        peer, [torch.tensor([0.01, -0.02]), torch.tensor([0.03, 0.04])])
    found = peer.catchup.catch_up(timeout=10.0)
    assert found.adopted and peer.hash() == digest and peer.transport.downloads == []
    assert torch.equal(peer.state.params, params) and torch.equal(peer.state.momentum, momentum)
    assert (peer.state.epoch, peer.state.tokens_total, peer.state.merged) == (epoch, tokens, merged)
    assert torch.allclose(peer.state.params - peer.theta, delta)  # our own work kept, on the new state
    assert [asked[1] for asked in peer.transport.replayed] == [4, 5]


def test_a_round_nobody_serves_falls_back_to_the_download():
    peer = FakePeer(numel=8, run=FOUR)
    peer.train()
    digest, (params, momentum, epoch, tokens, merged) = swarm_rounds(
        peer, [torch.tensor([0.01, -0.02]), torch.tensor([0.03, 0.04])])
    del peer.transport.results[(5, next(h for (e, h) in peer.transport.results if e == 5))]
    peer.transport.served[digest] = (dict(epoch=epoch, tokens_total=tokens, merged=merged, hash=digest),
                                     [params, momentum])
    found = peer.catchup.catch_up(timeout=10.0)
    assert found.adopted and peer.hash() == digest and peer.transport.downloads == [(("a", "b"), digest)]


def test_a_result_of_another_lineage_is_not_adopted():
    """The holders' state came from another round than the one served for our state (a fork): the replayed end
    state fails the hash of theirs, nothing is adopted, and the download decides."""
    peer = FakePeer(numel=8, run=FOUR)
    peer.train()
    before = peer.hash()
    digest, _ = swarm_rounds(peer, [torch.tensor([0.01, -0.02])])
    key = next(iter(peer.transport.results))
    averaged, _ = peer.transport.results[key]
    peer.transport.results[key] = (averaged, torch.tensor([0.5, 0.5]))  # what another group applied
    found = peer.catchup.catch_up(timeout=10.0)
    assert not found.adopted and peer.hash() == before and peer.transport.downloads == [(("a", "b"), digest)]
