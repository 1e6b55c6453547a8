"""Streaming fragments (--fragments F), in-process: a round averages one fragment of the flat vector, its outer step
changes that fragment of G alone, and the rest of the local model keeps its work (peer/outer/fragments.py)."""

import dataclasses
import re
import statistics

import pytest
import torch

from peer.config import RunConfig
from peer.outer.fragments import Fragments
from peer.outer.nesterov import nesterov_step
from peer.outer.state import merge_contributors, state_hash
from peer.round.outcomes import Outcome
from peer.swarm.failures import MaybeApplied
from tests.harness.fake import FakePeer, record, with_group
from tests.test_local import flat, make
from tests.test_sync import holder, theirs

FOUR = RunConfig(align_every=0, inner_steps=8, fragments=4).resolved()


def test_fragments_cut_the_flat_vector_into_contiguous_parts_that_cover_it_once():
    fragments = Fragments(10, 4)
    parts = [fragments.of(epoch) for epoch in range(4)]
    assert fragments.size == 3 and parts == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert fragments.of(5) == parts[1]  # round e averages fragment e mod F
    assert Fragments(10, 1).of(7) == slice(0, 10) and Fragments(10, 1).whole()
    with pytest.raises(ValueError, match="fragments must be in"):
        Fragments(3, 4)


def test_a_round_is_h_over_f_steps_and_a_fragment_counts_its_own_outer_steps():
    run = RunConfig(inner_steps=100, fragments=4, outer_warmup=2, outer_lr=0.7, outer_momentum=0.9)
    assert run.round_steps == 25 and run.global_step(6) == 150
    # the first outer step of every fragment is plain averaging; each fragment's second is half-way to Nesterov
    lrs = [run.outer_lr_at(run.global_step(epoch)) for epoch in range(9)]
    assert lrs[:4] == [1.0] * 4 and lrs[4:8] == [0.85] * 4 and lrs[8] == 0.7
    odd = RunConfig(inner_steps=50, fragments=4, outer_warmup=2)  # H rounded down to a multiple of F: rounds of 12
    assert odd.round_steps == 12 and [odd.outer_lr_at(odd.global_step(e)) for e in (3, 4, 8)] == [1.0, 0.85, 0.7]
    with pytest.raises(ValueError, match="inner_steps must be at least fragments"):
        RunConfig(inner_steps=3, fragments=4)


def test_a_round_sends_one_fragment_and_steps_that_fragment_of_g_alone():
    peer = FakePeer(numel=8, run=FOUR)
    before_g, delta = peer.state.params.clone(), peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer))))
    part = peer.synchronizer.outer.part()
    assert part == slice(0, 2)  # epoch 4: fragment 0 of 4
    result = peer.sync(tokens=100)
    assert result.applied and peer.state.epoch == 5
    sent = peer.transport.sent[0][2]
    assert sent.numel() == 2 and torch.equal(sent, delta[part])  # a quarter of the model on the wire
    average = delta[part] * 0.5  # ours and a zero from "a", by tokens
    params, momentum = before_g[part].clone(), torch.zeros(2)
    step = FOUR.global_step(4)
    nesterov_step(params, momentum, average, FOUR.outer_lr_at(step), FOUR.outer_momentum_at(step))
    assert torch.equal(peer.state.params[part], params)
    assert torch.equal(peer.state.params[2:], before_g[2:]) and not peer.state.momentum[2:].any()
    theta = peer.theta
    assert torch.equal(theta[part], peer.state.params[part])  # theta <- G in the averaged fragment
    assert torch.equal(theta[2:], before_g[2:] - delta[2:])  # the rest keeps its local work


def test_every_fragment_is_averaged_once_every_f_rounds():
    peer = FakePeer(numel=8, run=FOUR)
    start = peer.state.params.clone()
    moved = []
    for _ in range(4):
        peer.train()
        before = peer.state.params.clone()
        assert peer.sync(tokens=100).applied  # alone: steps alone
        moved.append(tuple((peer.state.params != before).nonzero().flatten().tolist()))
    assert moved == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert (peer.state.params != start).all() and peer.state.epoch == 8


def test_the_members_of_a_fragment_round_hold_one_state():
    """Two members with different local work apply the same averaged fragment: the same hash."""
    members = [FakePeer(numel=8, run=FOUR, peer_id=name) for name in ("p", "q")]
    average = torch.tensor([0.01, -0.02])
    for index, peer in enumerate(members):
        peer.train(step=0.01 * (index + 1))
        other = members[1 - index]
        peer.transport.peers[other.announcer.identity.peer_id] = record(
            other.announcer.identity.peer_id, peer.state.epoch, peer.hash(), peer.state.tokens_total)
        peer.transport.scripts.append(with_group((other.announcer.identity.peer_id, theirs(peer)), average=average))
    results = [peer.sync(tokens=100) for peer in members]
    assert all(r.applied for r in results)
    assert members[0].hash() == members[1].hash()
    assert not torch.equal(members[0].theta, members[1].theta)  # their other fragments keep their own work


def test_error_feedback_keeps_the_residual_of_the_fragment_sent_only():
    run = dataclasses.replace(FOUR, error_feedback=True)
    peer = FakePeer(numel=4096, run=run, codec="int8")
    peer.train(step=0.0123)
    assert peer.sync(tokens=100).applied
    residual = peer.feedback.residual
    part = Fragments(4096, 4).of(4)
    assert residual[part].abs().sum() > 0 and not residual[part.stop:].any() and not residual[: part.start].any()


def test_a_member_whose_group_finished_without_it_sets_that_fragment_and_keeps_the_rest():
    """OURS_MERGED with fragments: the adopted state merged our fragment; theta <- G_new there, the other
    fragments keep their work, shifted onto the new state."""
    peer = FakePeer(numel=8, run=FOUR)
    delta = peer.train()
    holder(peer)
    part = peer.synchronizer.outer.part()
    moved = torch.zeros(8)
    moved[part] = 0.5
    moved[4:] = 0.25  # the new state differs elsewhere too (how a test stands for any other change)

    def finished_without_us(*_):
        digest = serve(peer, moved, ["a", "me"])
        peer.transport.peers["a"] = record("a", 5, digest, peer.state.tokens_total + 200)
        raise MaybeApplied("our reducer finished; a part from a failed")

    peer.transport.scripts.append(finished_without_us)
    before = peer.state.params.clone()
    result = peer.sync(tokens=100)
    assert result.outcome is Outcome.GROUP_FINISHED_WITHOUT_US and peer.state.epoch == 5
    theta = peer.theta
    assert torch.equal(theta[part], peer.state.params[part])
    rest = slice(part.stop, None)
    assert torch.allclose(theta[rest], peer.state.params[rest] - delta[rest])  # the work kept, on the new state
    assert not torch.equal(peer.state.params, before)


def serve(peer, new_params_shift, contributors):
    """A state one step on from ours whose G is ours + ``new_params_shift``, served by its holders."""
    params, momentum = peer.state.params + new_params_shift, peer.state.momentum.clone()
    merged = merge_contributors(peer.state.merged, contributors, peer.state.epoch)
    digest = state_hash(params, momentum, peer.state.epoch + 1)
    peer.transport.served[digest] = (dict(epoch=peer.state.epoch + 1, tokens_total=peer.state.tokens_total + 200,
                                          merged=merged, hash=digest), [params, momentum])
    return digest


def test_with_overlap_a_fragment_step_keeps_the_steps_taken_since_everywhere():
    local, params = make([1.0, 2.0, 3.0, 4.0])
    local.freeze(with_moments=False)
    proxy = torch.tensor([1.0, 2.0, 30.0, 40.0])  # the eager step moved fragment 1 of 2 only
    local.start(proxy)
    with torch.no_grad():
        for p in params:
            p.sub_(0.5)  # the next round's steps
    local.set(torch.tensor([0.0, 0.0, 10.0, 10.0]), slice(2, 4))  # the real outer step of fragment 1 lands
    assert torch.equal(flat(params), torch.tensor([0.5, 1.5, 9.5, 9.5]))
    local.thaw()
    assert torch.equal(local.gather(torch.empty(4)), flat(params))


@pytest.mark.slow
def test_three_real_peers_with_fragments_agree_learn_and_send_one_fragment_a_round(tmp_path):
    """Three ``python -m peer`` processes with --fragments 2 and --overlap: every group holds one state hash every
    round, loss falls, and a round's all-reduce moves about one fragment: half the model, not all of it."""
    from peer.train.model import build_model, count_parameters
    from peer.train.tokenizer import load_tokenizer
    from tests.harness.swarm import Swarm, assert_all_leave, assert_groups_agree, assert_loss_fell, wait_until

    swarm = Swarm(tmp_path)
    try:
        peers = [swarm.peer(f"p{i}", "--fragments", "2", "--inner-steps", "10", "--overlap") for i in range(3)]
        wait_until(lambda: all(p.reached(lambda m: sum(r["applied"] and r["group_size"] == 3 for r in m) >= 6)
                               for p in peers), 300, "6 rounds of all three peers each")
        assert_all_leave(peers, 60)
    finally:
        swarm.close()
    assert assert_groups_agree(peers) >= 6 * 3
    assert_loss_fell(peers)
    # an exact all-reduce of n members sends 2 (n - 1) payloads in all, 2 (n - 1) / n a member on average (a
    # payload smaller than one part has one reducer, which sends 2 of them here, the others 1): fp16, one fragment
    params = count_parameters(build_model("micro", load_tokenizer("bytes").vocab_size, 64, 0))
    fragment_bytes = 2 * -(-params // 2)
    # (an aligned round sends the moment too; a retried one sends again: in CI the first round's all-reduce lost a
    # sender under the start's load, and its 2 attempts put the mean at 1.12. A round in which a later peer joined
    # counts the state its donors served: on Python 3.12 one peer's first round sent 1.2 MB where the others sent
    # 0.23, and put the mean at 1.30. Only rounds after the last peer's first one are measured.)
    joined = max(p.metrics[0]["epoch"] for p in peers)
    full = [r["bytes_sent"] for p in peers for r in p.metrics if r["epoch"] > joined
            and r["applied"] and r["group_size"] == 3 and not r["aligned"] and r["attempts"] == 1]
    assert 0.9 < statistics.mean(full) / (2 * 2 / 3 * fragment_bytes) < 1.1, (statistics.mean(full), params)


def test_with_round_seconds_each_fragment_is_averaged_every_round_seconds():
    run = RunConfig(round_seconds=40.0, fragments=4, inner_steps=8)
    assert run.seconds_per_round == 10.0 and RunConfig(round_seconds=40.0).seconds_per_round == 40.0


@pytest.mark.slow
def test_a_peer_that_missed_rounds_replays_them_instead_of_downloading_the_state(tmp_path):
    """A peer killed in a round of --fragments 2 and restarted from its checkpoint finds the swarm a few rounds
    ahead: it takes the rounds' results from the peers that hold them and steps itself (a fragment at the wire codec
    each, not the 8 bytes a parameter of G and m), and is back in the groups on the swarm's hash. (A SIGSTOP froze
    the peer here before: the survivors' sync then stalled for the whole freeze whenever the CPU was busy, the
    frozen peer's DHT node accepting connections and answering nothing, so it never fell behind.)"""
    from peer.train.model import build_model, count_parameters
    from peer.train.tokenizer import load_tokenizer
    from tests.harness.swarm import Swarm, assert_all_leave, assert_groups_agree, wait_until

    swarm = Swarm(tmp_path)
    # rounds of 5 paced steps (3 s): a restart (3-15 s on a busy machine) falls 1 to 5 rounds behind, within the
    # REPLAY_ROUNDS (8) that a peer replays rather than downloads. The members must keep that many results: they keep
    # at most KEPT_ROUNDS, within one fp32 copy of G's bytes, which the harness's fp16 (with its aligned rounds at
    # twice the bytes) fills in 3-4 fragment rounds, so this swarm runs the product's codec: 8 rounds kept.
    flags = ("--compression", "int4-huffman", "--align-every", "0", "--fragments", "2", "--inner-steps", "10",
             "--min-step-seconds", "0.6", "--checkpoint-dir", str(tmp_path / "late-ckpt"))
    try:
        peers = [swarm.peer(f"p{i}", *flags[:-2]) for i in range(2)]
        late = swarm.peer("late", *flags, faults="kill@inner:4")
        wait_until(lambda: not late.alive(), 120, "the late peer to be killed in its round 4")
        killed_at = max(r["epoch"] for r in late.metrics)
        wait_until(lambda: peers[0].reached(lambda m: bool(m) and m[-1]["epoch"] >= killed_at + 1), 60,
                   "the swarm to move on")
        back = swarm.peer("late-back", *flags, metrics_path=late.metrics_path)
        wait_until(lambda: "downloading the state" in back.stderr or "by replaying" in back.stderr and back.reached(
            lambda m: sum(r["applied"] and r["group_size"] == 3 and r["epoch"] > killed_at + 2 for r in m) >= 2),
            240, "the restarted peer to replay the rounds it missed and rejoin")
        assert_all_leave(peers + [back], 60)
    finally:
        swarm.close()
    assert assert_groups_agree(peers + [back]) >= 6
    # it replayed, and downloaded no state (the download's own line: "... downloading the state from N peer(s)")
    assert "by replaying" in back.stderr and "downloading the state" not in back.stderr, back.stderr[-2000:]
    # the restart's first round received each replayed round's result (half the model at int4, a sixteenth of G and
    # m's bytes, plus the streams' overhead) and its own round's average: far less a round than the state
    replayed = int(re.search(r"by replaying (\d+) round", back.stderr).group(1))
    state_bytes = 2 * 4 * count_parameters(build_model("micro", load_tokenizer("bytes").vocab_size, 64, 0))
    first = next(r for r in back.metrics if r.get("resumed_hash"))
    own_round = max(r["bytes_received"] for r in peers[0].metrics)
    assert first["bytes_received"] < own_round + replayed * state_bytes / 3, (first["bytes_received"], replayed)


@pytest.mark.slow
def test_a_peer_restarted_behind_a_peer_that_stepped_alone_replays_its_lone_steps(tmp_path):
    """Of a swarm of two, one is killed; the survivor steps alone, serving each lone step (its quantized delta) as
    the round's result. The killed peer, restarted from its checkpoint a few rounds behind, replays those steps to
    the survivor's hash, downloads no state, and the two meet in groups again."""
    from tests.harness.swarm import Swarm, assert_all_leave, assert_groups_agree, wait_until

    swarm = Swarm(tmp_path)
    flags = ("--compression", "int4-huffman", "--align-every", "0", "--inner-steps", "5", "--min-step-seconds", "0.6")
    checkpoint = ("--checkpoint-dir", str(tmp_path / "late-ckpt"))
    try:
        survivor = swarm.peer("survivor", *flags)
        late = swarm.peer("late", *flags, *checkpoint, faults="kill@inner:4")
        wait_until(lambda: not late.alive(), 120, "the late peer to be killed in its round 4")
        killed_at = max(r["epoch"] for r in late.metrics)
        wait_until(lambda: survivor.reached(lambda m: sum(r["applied"] and r["group_size"] == 1 and
                                                          r["epoch"] > killed_at for r in m) >= 2), 90,
                   "the survivor to step alone twice")
        back = swarm.peer("late-back", *flags, *checkpoint, metrics_path=late.metrics_path)
        wait_until(lambda: "downloading the state" in back.stderr or "by replaying" in back.stderr and back.reached(
            lambda m: sum(r["applied"] and r["group_size"] == 2 and r["epoch"] > killed_at + 2 for r in m) >= 2),
            180, "the restarted peer to replay the lone steps and rejoin")
        assert_all_leave([survivor, back], 60)
    finally:
        swarm.close()
    assert "by replaying" in back.stderr and "downloading the state" not in back.stderr, back.stderr[-2000:]
    assert assert_groups_agree([survivor, back]) >= 2
