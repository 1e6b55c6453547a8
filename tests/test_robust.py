"""Robust aggregation of one all-reduce part (pure tensors): NaN rejected, outliers clipped, honest unchanged."""

import pytest
import torch

from peer.averaging.robust import robust_mean


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


def test_a_part_scaled_by_1000_is_dropped_like_an_absent_one():
    parts = honest(4)
    without = {i: parts[i] for i in range(3)}
    parts[3] = (parts[3][0] * 1000, parts[3][1])
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert [(o.sender, o.reason, o.severe) for o in offences] == [(3, "rejected", True)]
    plain = weighted_mean(parts)
    assert (plain - weighted_mean(without)).norm() > 100 * weighted_mean(without).norm()  # a plain average
    # the honest 3's own robust mean: the dropped part only moved the median center, never the deviations' mean
    assert (result - weighted_mean(without)).norm() < 0.05 * weighted_mean(without).norm()


def test_a_part_a_few_times_too_far_is_clipped_not_banned():
    parts = honest(5)
    clean = weighted_mean(dict(parts))
    center = torch.stack([p for p, _ in parts.values()]).median(dim=0).values
    parts[4] = (center + 8 * (parts[4][0] - center), parts[4][1])  # a stale peer's larger delta, say
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert [(o.sender, o.reason, o.severe) for o in offences] == [(4, "clipped", False)]
    assert (result - clean).norm() < (weighted_mean(parts) - clean).norm() / 2


def test_order_of_arrival_does_not_matter_and_two_senders_are_never_clipped():
    parts = honest(5)
    forward, _ = robust_mean(parts, clip_factor=2.0)
    backward, _ = robust_mean(dict(reversed(list(parts.items()))), clip_factor=2.0)
    assert torch.equal(forward, backward)
    pair = {0: (torch.full((10,), 2.0), 1.0), 1: (torch.full((10,), 50.0), 1.0)}
    result, offences = robust_mean(pair, clip_factor=2.0)
    assert offences == [] and torch.equal(result, torch.full((10,), 26.0))


def test_two_senders_1000_times_apart_fail_the_round_instead_of_averaging():
    parts = honest(2)
    parts[1] = (1000 * parts[1][0], parts[1][1])  # a peer sending 1000 x its pseudo-gradient, alone with one other
    with pytest.raises(ValueError, match="no telling which is wrong"):
        robust_mean(parts, clip_factor=2.0)
    assert robust_mean(parts, clip_factor=0)[0].abs().max() > 100  # with robustness off, it would poison the mean


def test_nothing_usable_is_an_error():
    with pytest.raises(ValueError, match="no sender's part is usable"):
        robust_mean({0: (torch.tensor([float("inf")]), 1.0)}, clip_factor=2.0)


def test_a_sender_with_no_work_is_averaged_in_not_taken_for_an_attacker():
    """A peer that dropped its rounds past --max-staleness as the next round began sent an all-zero part: paired with
    one honest peer, the round failed as two parts infinitely far apart in norm (16 peers on a loaded machine)."""
    parts = honest(2)
    parts[1] = (torch.zeros(1000), parts[0][1])
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert offences == [] and torch.allclose(result, parts[0][0] / 2)  # it shrinks the step by its weight


def test_a_member_with_no_work_adds_nothing_and_offends_nobody():
    """A peer that dropped its rounds past --max-staleness as the next round began has no tokens: weight 0. Its part
    is left out of the mean and of the median. Its reducers once took weight 0 for a malformed part and counted an
    offence toward a ban (the hard row, bench/results/wan.md)."""
    parts = honest(3)
    expected, _ = robust_mean(parts, clip_factor=2.0)
    parts[3] = (1000 * torch.ones(1000), 0.0)
    result, offences = robust_mean(parts, clip_factor=2.0)
    assert offences == [] and torch.equal(result, expected)
    with pytest.raises(ValueError, match="weightless"):
        robust_mean({3: parts[3]}, clip_factor=2.0)


def test_a_sender_whose_stream_is_cancelled_fails_the_part_as_its_own_loss():
    """hivemind cancels a stream handler's task when the stream closes; the part future every sender and our own
    part await must not be cancelled with it, or the whole group reads a cancellation instead of the lost sender."""
    import asyncio

    from peer.averaging.parts import RobustPartReducer
    from peer.swarm.failures import GroupLostMember

    async def run():
        reducer = RobustPartReducer((torch.Size([4]),), 3, clip_factor=0.0, ignored=set(), on_offence=lambda o: None)
        own = asyncio.create_task(reducer.accumulate_part(0, 0, torch.ones(4)))
        theirs = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((4,), 3.0)))
        await asyncio.sleep(0)
        theirs.cancel()  # its stream closed
        await asyncio.sleep(0)
        assert theirs.cancelled() and not own.done()
        reducer.on_sender_failed(1)  # what hivemind's handler does next (``_ban_sender``)
        with pytest.raises(GroupLostMember, match="sender #1 failed"):
            await own

    asyncio.run(run())



def test_a_resumed_stream_sends_a_part_again_and_it_counts_once():
    """A sender whose stream broke resumes it from the averages it has and sends again a part that is in already
    (``ExactAllReduceRunner.rpc_aggregate_part``): the reducer answers it with that part's average and adds it once;
    a part sent out of order fails the reduction by name."""
    import asyncio

    from peer.averaging.parts import RobustPartReducer
    from peer.swarm.failures import GroupLostMember

    async def run():
        shapes = (torch.Size([4]), torch.Size([4]))
        reducer = RobustPartReducer(shapes, 2, clip_factor=0.0, ignored=set(), on_offence=lambda o: None)
        broken = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((4,), 3.0)))
        await asyncio.sleep(0)
        broken.cancel()  # its stream broke while its part waited for ours
        again = asyncio.create_task(reducer.accumulate_part(1, 0, torch.full((4,), 3.0)))
        own = await reducer.accumulate_part(0, 0, torch.ones(4))
        assert torch.equal(own, torch.full((4,), 2.0)) and torch.equal(await again, own)  # (1 + 3) / 2, not / 3
        assert reducer.accumulated == [1, 1]
        with pytest.raises(GroupLostMember, match="sent part 1 before part 0"):
            await RobustPartReducer(shapes, 2, clip_factor=0.0, ignored=set(),
                                    on_offence=lambda o: None).accumulate_part(1, 1, torch.ones(4))

    asyncio.run(run())
