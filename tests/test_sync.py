"""One round's sync, run in-process on a fake transport and clock: each path of the decision, end to end.

Each test scripts the swarm around one peer (the others' records, the states their holders serve, what each
averaging attempt returns or raises) and asserts what a sync must leave behind: the outcome, the state and its
hash, what was sent and how often, and the lineage bookkeeping. Milliseconds each.
"""

import concurrent.futures
import dataclasses
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from dht.processes import LinkLost, part_died
from peer.config import RunConfig
from peer.outer.nesterov import nesterov_step
from peer.outer.state import state_hash
from peer.round import transport as real
from peer.round.inflight import sync_round
from peer.round.outcomes import Outcome
from peer.round.schedule import RoundClock
from peer.swarm.consensus import MAX_MISSED, SYNCING, responsive
from peer.swarm.failures import DelegateLost, GroupLostMember, MaybeApplied, MinorityGroup, NoGroup, NoMajority
from peer.swarm.metadata import Contribution
from peer.swarm.timing import LATE_HEADROOM, MAX_STRETCH, SYNC_HEADROOM
from tests.harness.fake import FakeClock, FakePeer, across, record, with_group


def stepped(peer, delta):
    """G and m after one outer step from the peer's state with ``delta``."""
    params, momentum = peer.state.params.clone(), peer.state.momentum.clone()
    step = peer.run.global_step(peer.state.epoch)
    nesterov_step(params, momentum, delta, peer.run.outer_lr_at(step), peer.run.outer_momentum_at(step))
    return params, momentum


def holder(peer, name="a", **fields):
    """Another peer at our exact state."""
    peer.transport.peers[name] = record(name, peer.state.epoch, peer.hash(), peer.state.tokens_total, **fields)


def failing(error, meanwhile):
    """An attempt that fails with ``error`` after ``meanwhile()`` changed the swarm (a state appears, say)."""
    def run(*_):
        meanwhile()
        raise error

    return run


def theirs(peer, tokens=100, **fields):
    return Contribution(epoch=peer.state.epoch, hash=peer.hash(), tokens=tokens, **fields)


def test_a_lone_peer_steps_alone():
    peer = FakePeer()
    delta = peer.train()
    expected = stepped(peer, delta)
    result = peer.sync(tokens=100)
    assert result.applied and result.outcome is Outcome.APPLIED and result.group == ("me",)
    assert torch.equal(peer.state.params, expected[0]) and torch.equal(peer.state.momentum, expected[1])
    assert peer.state.epoch == 5 and peer.state.tokens_total == 1100 and torch.equal(peer.theta, peer.state.params)
    assert peer.transport.published[-1].state_hash == peer.hash()  # the new state, published at once


def test_a_group_applies_the_average_identically_and_agrees_the_next_round():
    peer = FakePeer()
    peer.train()
    holder(peer)
    average = torch.full((8,), 0.004)
    peer.transport.scripts.append(with_group(("a", theirs(peer, tokens=300, step_seconds=0.5)), average=average))
    expected = stepped(peer, average)
    result = peer.sync(tokens=100, step_seconds=0.3)
    assert result.applied and result.group == ("a", "me") and result.group_tokens == 400
    assert torch.equal(peer.state.params, expected[0])  # the group's average, not our own delta
    assert peer.state.tokens_total == 1400 and peer.state.merged == {"a": 4, "me": 4}
    assert result.next_round_seconds == peer.run.inner_steps * 0.4  # H steps at the median member's pace
    sent, weight, _ = peer.transport.sent[0]
    assert (sent.epoch, sent.hash, sent.tokens, sent.step_seconds, weight) == (4, peer.transport.prepared[0]["hash"],
                                                                              100, 0.3, 100.0)
    assert peer.transport.prepared[0]["expected"] == 2 and peer.transport.prepared[0]["probe"] == ("a",)
    assert peer.transport.prepared[0]["members"] == ("a",)


def test_stale_work_weighs_less():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer))))
    peer.sync(tokens=100, missed_rounds=2)
    assert peer.transport.sent[0][1] == 100 * peer.run.stale_discount ** 2


def test_a_lost_member_is_retried_from_the_untouched_tensors_and_then_applies():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([GroupLostMember("sender #1 failed"), with_group(("a", theirs(peer)))])
    before = peer.state.params.clone()
    result = peer.sync()
    assert result.applied and result.attempts == 2
    first, second = peer.transport.sent[0][2], peer.transport.sent[1][2]
    assert torch.equal(first, second)  # the retry sent the same delta: the failed attempt changed nothing
    assert not torch.equal(peer.state.params, before)


def test_a_connection_reset_tells_once_how_to_bound_the_socket_queues(tmp_path, monkeypatch, caplog):
    from peer.averaging import pacing

    setting = tmp_path / "tcp_notsent_lowat"
    setting.write_text("4294967295\n")
    monkeypatch.setattr(pacing, "NOTSENT_LOWAT", str(setting))
    peer = FakePeer()
    peer.train()
    holder(peer)
    reset = GroupLostMember("lost reducer Qm1: ConnectionResetError(104, 'Connection reset by peer')")
    peer.transport.scripts.extend([reset, reset, with_group(("a", theirs(peer)))])
    with caplog.at_level(logging.WARNING, logger="peer.round.sync"):
        assert peer.sync().applied
    hints = [r.message for r in caplog.records if "tcp_notsent_lowat" in r.message]
    assert len(hints) == 1  # once, not at every reset


def test_the_first_attempt_meets_at_the_planned_end_and_a_retry_at_once():
    # an early peer (it stopped before a step that would end after the planned end) waits for its group from then
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([GroupLostMember("sender #1 failed"), with_group(("a", theirs(peer)))])
    planned = peer.clock.now + 4.0
    budget = peer.synchronizer.round_budget()
    result = peer.sync(budget=budget, meet_at=planned)
    assert result.applied and [p["meet_at"] for p in peer.transport.prepared] == [planned, None]


def test_a_sync_far_ahead_of_its_meeting_reads_the_swarm_and_joins_a_window_before_it():
    # a fast peer, or a sync launched as the next round began, is 100 s early. A group's leader closes it at the count
    # it expects, so a view read now would leave b out (its record shows our state only later): 24 simulated peers
    # in groups of 8 lost 12% of their syncs to it (bench/scale.py)
    peer = FakePeer()
    peer.train()
    holder(peer, "a")
    reads, plain, sleep = [], peer.transport.read_records, peer.clock.sleep

    def read_records(timeout):
        reads.append(peer.clock.now)
        return plain(timeout)

    def sleep_then_b_arrives(seconds):
        sleep(seconds)
        holder(peer, "b")

    peer.transport.read_records, peer.clock.sleep = read_records, sleep_then_b_arrives
    peer.transport.scripts.append(with_group(("a", theirs(peer)), ("b", theirs(peer))))
    meet_at, budget, window = peer.clock.now + 100.0, peer.synchronizer.round_budget(), peer.synchronizer.grace()
    result = peer.sync(budget=budget, meet_at=meet_at)
    assert result.applied and result.group == ("a", "b", "me")
    assert peer.transport.prepared[0]["expected"] == 3 and peer.transport.prepared[0]["meet_at"] == meet_at
    assert reads[0] == meet_at - window  # nothing read before
    assert result.waited == 100.0 and result.deadline == budget + 100.0


def test_the_round_ends_before_a_step_that_would_end_after_its_planned_end():
    clock = FakeClock()
    round_clock = RoundClock(RunConfig().resolved(), None, None, None, threading.Event(), clock, lambda _: None)
    round_clock.began, round_clock.deadline = clock.now, clock.now + 10.0
    clock.sleep(3.0)  # one step of 3 s: the pace before any is known
    assert not round_clock.over(1)  # a second ends at 6, a third at 9
    clock.sleep(6.0)
    assert round_clock.over(3)  # a fourth would end at 12: we are 1 s early, not 2 s late
    round_clock.step_seconds = 0.5  # a known pace wins over this round's
    assert not round_clock.over(3)
    assert not round_clock.over(0) and not RoundClock(RunConfig(), None, None, None, None, clock, None).over(5)


def test_with_overlap_the_next_round_counts_from_the_agreed_end_or_from_a_late_sync():
    clock = FakeClock()
    round_clock = RoundClock(RunConfig(align_every=0).resolved(), None, None, None, threading.Event(), clock,
                             lambda _: None)
    round_clock.finish(50, 25.0, 60.0, anchor=1000.0, ended=990.0)  # the sync ended inside the round it overlapped
    assert round_clock.agreed_end == 1060.0
    round_clock.finish(50, 25.0, 60.0, anchor=1000.0, ended=1040.0)  # it overran that round by 40 s
    assert round_clock.agreed_end == 1100.0  # a whole round from then, not 20 s of one


@pytest.mark.parametrize("someone_late", [False, True])
def test_with_overlap_a_peer_catching_up_is_told_to_the_group_whose_next_round_leaves_it_time_to_replay(
        someone_late):
    """With overlap a group's state is the result of an all-reduce that ends as the group meets again, so a peer that
    missed one group could replay that result only after the next group had met: on a link whose syncs fill a
    round, a peer missed 18 groups in a row that way, one epoch behind (bench/results/wan.md, the hard row)."""
    peer = FakePeer()
    peer.train()
    holder(peer)
    epoch = peer.state.epoch
    peer.state.merged = {"a": epoch - 1, "b": epoch - 1, "me": epoch - 1}  # the group that produced our state
    peer.transport.peers["b"] = record("b", epoch - 1, "older", 900)  # a producer, its record not yet republished
    if someone_late:
        peer.transport.peers["late"] = record("late", epoch - 1, "older", 900, next_sync_at=peer.clock.now + 30.0)
    planned = peer.run.round_steps * 1.0  # H steps at the members' pace of 1 s
    peer.synchronizer.meeting.sync_seconds = planned / 1.5  # syncs fill two thirds of a round: it needs no stretch
    peer.transport.scripts.append(with_group(("a", theirs(peer, step_seconds=1.0, sync_seconds=planned / 1.5))))
    result = peer.sync(tokens=100, step_seconds=1.0, overlapped=True)
    assert result.applied and peer.transport.sent[0][0].late == someone_late
    assert result.next_round_seconds == (LATE_HEADROOM * planned / 1.5 if someone_late else planned)


def test_with_overlap_a_sync_that_is_over_publishes_the_plan_of_the_round_in_progress():
    """Our record said "syncing" until the end of the round the sync overlapped: a peer that adopted our state took
    us for a group waiting for it and ended its round at once, to meet nobody (bench/scale.py's 16 peers in groups
    of 8: 94% of syncs applied, 97% after)."""
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer, planned_end=1960.0))))
    plans, planned = [], threading.Event()
    planned.set()  # the round in progress was planned: to end at 1900
    clock = SimpleNamespace(planned=planned, target=1900.0, publish=plans.append, realign=lambda: None)
    clock.retarget = lambda end: setattr(clock, "target", end)
    clock.plan = lambda: clock.target
    result = sync_round(peer.synchronizer, clock, 100, 1, peer.synchronizer.round_budget(), 0.5, None, overlap=True)
    assert result.applied and peer.transport.published[-1].status == SYNCING  # what the sync said last
    assert plans == [1930.0]  # then the group's agreed end of the round in progress, the median of 1900 and 1960


def test_a_round_whose_planned_end_has_passed_is_published_as_ending_within_a_step():
    """A sync that overran its round retargets that round to the group's agreed end, already passed: the round ends
    at its next step. Published as it was, the stale end made the peer look silent (``responsive``) the moment it
    published it, and its group closed without it (bench/scale.py: 16 peers, 4 at 6-s steps, a missed group)."""
    clock = FakeClock(1000.0)
    round_clock = RoundClock(RunConfig(align_every=0).resolved(), None, None, None, threading.Event(), clock,
                             lambda _: None)
    assert round_clock.plan() is None  # no plan: none told
    round_clock.retarget(1030.0)
    assert round_clock.plan() == 1030.0  # ahead: as agreed
    clock.now = 1045.0  # the sync ended 15 s past it, the peer still in its step
    round_clock.step_seconds = 6.0
    assert round_clock.plan() == 1051.0
    first_round = record("slow", 4, "s", 100, next_sync_at=1030.0)  # round_seconds unknown before a first finish
    assert not responsive(first_round, 1045.5)
    assert responsive(dataclasses.replace(first_round, next_sync_at=round_clock.plan()), 1045.5)


def test_a_round_lined_up_from_the_records_skips_the_plans_of_the_round_just_ended():
    """With no agreed end (the last sync failed), the next round lines up with the plans in the records. A plan that
    ends with the round we just ended is that round's, by a peer that has not begun its next one: lined up with, our
    next round lasted one step (seen in bench.scale with overlap, where the sync after it then waited a whole round
    in matchmaking)."""
    clock = FakeClock()
    run = RunConfig(align_every=0, grace_seconds=5.0).resolved()
    mine = record("me", 4, "s", 100)
    records = {name: record(name, 4, "s", 100, next_sync_at=end)
               for name, end in (("a", 1001.0), ("b", 1001.0), ("c", 1061.0))}
    plans = []
    round_clock = RoundClock(run, SimpleNamespace(catch_up=lambda timeout: SimpleNamespace(adopted=False)),
                             SimpleNamespace(records=records), SimpleNamespace(record=lambda: mine),
                             threading.Event(), clock, plans.append)
    round_clock.target = 1001.0  # the round we just ended, one step before its planned end
    round_clock.begin()
    assert round_clock.target == 1061.0 and round_clock.aligned  # c has begun its next round; a and b have not
    round_clock.target = 1001.0
    del records["c"]
    round_clock.begin()  # nobody has begun the next round: our own plan (no pace known yet), looking again later
    assert round_clock.target is None and not round_clock.aligned
    round_clock.target = None  # our first round (or one after a catch-up): the swarm's round is ours to join
    round_clock.begin()
    assert round_clock.target == 1001.0 and plans[-1] == 1001.0


def test_a_first_round_plans_by_the_pace_of_its_first_steps_and_lines_up_with_the_others():
    """A swarm's first round begins with no pace known, so with no plan, and every peer did its H steps: with steps 1-10
    s long they came to matchmaking minutes apart, and 72 of 256 first syncs found no group (``bench.scale``). Once its
    first steps tell its pace, a peer publishes H steps at it, and lines up with the plans of the others."""
    clock, plans = FakeClock(), []
    mine = record("me", 0, "s", 0)
    records = {"fast": record("fast", 0, "s", 0)}  # holds our state, no plan yet
    catchup = SimpleNamespace(catch_up=lambda timeout, poll=False: SimpleNamespace(adopted=False),
                              holders_syncing=lambda: False)
    run = RunConfig(align_every=0, inner_steps=100).resolved()
    round_clock = RoundClock(run, catchup, SimpleNamespace(records=records), SimpleNamespace(record=lambda: mine),
                             threading.Event(), clock, plans.append)
    assert round_clock.begin() == 100 and round_clock.target is None and plans == [None]
    clock.sleep(10.0)
    round_clock.watch(2)  # 2 steps of 5 s: too few to tell a pace
    assert plans == [None] and not round_clock.aligned
    clock.sleep(5.0)
    round_clock.watch(3)  # 97 more steps of 5 s: our plan, published
    assert plans == [None, 1015.0 + 97 * 5.0] and round_clock.target == plans[-1] and not round_clock.aligned
    records["fast"] = record("fast", 0, "s", 0, next_sync_at=1100.0)  # a faster peer's plan
    clock.sleep(5.0)
    round_clock.watch(4)
    assert round_clock.aligned and round_clock.target == 1100.0 and plans[-1] == 1100.0
    clock.sleep(75.0)
    assert not round_clock.over(19)  # 5-s steps: the 20th ends at 1100, as planned
    clock.sleep(5.0)
    assert round_clock.over(20)  # a 21st would end after it


def test_a_peer_lined_up_with_holders_in_a_sync_replays_its_result_as_soon_as_it_ends():
    """With overlap, holders in a sync meet next with its result. A peer that had missed their group and lined up with
    them sat on the state it caught up to until its round ended, then met them one epoch behind, replayed, and missed
    that group too: 18 rounds in a row on the hard row's 1 Mbit/s (bench/results/wan.md)."""
    clock = FakeClock()
    mine = record("me", 4, "s", 100)
    records = {name: record(name, 4, "s", 100, next_sync_at=1030.0, status=SYNCING, busy_until=1015.0)
               for name in ("a", "b")}
    looks, adopt = [], []

    def catch_up(timeout, poll=False):
        assert poll, "a look between inner steps waited for the DHT's lookup"
        looks.append(clock.now)
        return SimpleNamespace(adopted=bool(adopt))

    catchup = SimpleNamespace(catch_up=catch_up, holders_syncing=lambda: False)
    round_clock = RoundClock(RunConfig(align_every=0).resolved(), catchup, SimpleNamespace(records=records),
                             SimpleNamespace(record=lambda: mine), threading.Event(), clock, lambda _: None)
    round_clock.realign()  # our sync missed their group and caught up
    round_clock.watch()
    assert round_clock.target == 1030.0 and round_clock.aligned and round_clock.following
    clock.sleep(1.0)
    round_clock.watch()  # their sync still runs: looked again, nothing new
    assert looks == [1000.0, 1001.0] and round_clock.following
    clock.sleep(14.0)
    adopt.append(True)  # their sync ended with the next state: replayed at once, mid-round
    round_clock.watch()
    assert round_clock.rebased and not round_clock.following and round_clock.target == 1030.0
    clock.sleep(1.0)
    round_clock.watch()
    assert looks == [1000.0, 1001.0, 1015.0]  # then lined up as anyone: no more looks this round

    records.update({name: record(name, 4, "s", 100, next_sync_at=1050.0) for name in records})  # training holders:
    round_clock.realign()
    adopt.clear()
    round_clock.watch()
    clock.sleep(1.0)
    round_clock.watch()
    assert round_clock.aligned and not round_clock.following and looks[-1] == 1016.0  # lined up with, left alone


def test_news_of_a_healed_partition_is_worth_a_fresh_lookup():
    """An aligned peer looks once when a silent peer answers a ping, and not again: that look waits for a lookup of
    its own. A poll there would find no answer yet (its last lookup was answered at its sync), and the peer would
    notice the other half only at its next sync."""
    clock, looks = FakeClock(), []
    mine = record("me", 4, "s", 100)
    catchup = SimpleNamespace(catch_up=lambda timeout, poll=False: looks.append(poll) or SimpleNamespace(adopted=False),
                              holders_syncing=lambda: False)
    news = threading.Event()
    round_clock = RoundClock(RunConfig(align_every=0).resolved(), catchup, SimpleNamespace(records={}),
                             SimpleNamespace(record=lambda: mine), news, clock, lambda _: None)
    round_clock.aligned = True
    round_clock.watch()
    assert looks == []  # aligned, no news: no look
    news.set()
    round_clock.watch()
    clock.sleep(1.0)
    round_clock.watch()
    assert looks == [False] and not news.is_set()


def test_a_stretch_holds_until_the_group_agrees_again_and_is_told_once_each_way():
    clock = FakeClock()
    run = RunConfig(align_every=0).resolved()
    round_clock = RoundClock(run, None, None, None, threading.Event(), clock, lambda _: None)
    assert "stretched the next one to 69 s (2.76x" in round_clock.finish(50, 25.0, 69.0, stretch=2.76)
    assert round_clock.agreed_end == clock.now + 69.0 and round_clock.stretch == 2.76
    assert round_clock.finish(50, 25.0, 80.0, stretch=3.2) is None  # still stretched: nothing new to say
    assert round_clock.finish(50, 25.0, None) is None and round_clock.stretch == 3.2  # adopted, not agreed: kept
    assert "fit inside a round again: the next one lasts its planned 25 s" in round_clock.finish(50, 25.0, 25.0)
    assert round_clock.stretch == 1.0


def test_lost_members_until_the_retries_run_out_leave_the_state_alone():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([GroupLostMember("lost reducer")] * 3)
    before, theta = peer.state.params.clone(), peer.theta
    result = peer.sync()
    assert not result.applied and result.outcome is Outcome.LOST_MEMBER and result.attempts == 3
    assert result.error == "all-reduce failed (lost reducer); retrying with the survivors"
    assert torch.equal(peer.state.params, before) and torch.equal(peer.theta, theta) and peer.state.epoch == 4


def test_maybe_applied_adopts_the_groups_state_that_merged_our_delta_and_counts_it_once():
    peer = FakePeer()
    delta = peer.train()
    holder(peer)
    new = {}
    # the group finished without us: its members publish the state that merged our delta
    peer.transport.scripts.append(failing(MaybeApplied("lost reducer, after our reducer averaged all its parts"),
                                          lambda: new.update(hash=peer.serve_next_state(
                                              delta, contributors=["me", "a"], tokens=200, holders=["a"]))))
    result = peer.sync()
    new_hash = new["hash"]
    assert result.applied and result.rebased and result.outcome is Outcome.GROUP_FINISHED_WITHOUT_US
    assert peer.hash() == new_hash and torch.equal(peer.theta, peer.state.params)
    assert len(peer.transport.sent) == 1  # not averaged again
    assert peer.lineage.carried is None


def test_maybe_applied_with_no_state_appearing_is_retried_after_the_others_deadline():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([MaybeApplied("timed out"), with_group(("a", theirs(peer)))])
    start = peer.clock.now
    result = peer.sync()
    assert result.applied and result.attempts == 2
    assert peer.clock.now - start >= peer.run.grace_seconds  # it looked for their state until their deadline


def test_a_round_the_others_finished_without_us_is_adopted_then_our_work_goes_into_the_next_and_says_rebased():
    """Our reducer failed; the others applied without our delta. The settle adopts their state, and the retry
    averages our work at it, in the same sync: applied, and rebased (the metrics say it caught up)."""
    peer = FakePeer()
    delta = peer.train()
    holder(peer)
    new = {}
    peer.transport.scripts.extend([
        failing(MaybeApplied("lost reducer"),
                lambda: new.update(hash=peer.serve_next_state(delta * 0.5, contributors=["a"], tokens=100,
                                                              holders=["a"]))),
        lambda *args: with_group(("a", theirs(peer)))(*args)])  # "a" at the state we adopted by then
    result = peer.sync()
    assert result.applied and result.rebased and peer.transport.sent[1][0].hash == new["hash"]


def test_a_minority_group_adopts_the_majoritys_state_instead_of_forking():
    peer = FakePeer()
    delta = peer.train()
    holder(peer)
    new = {}
    peer.transport.scripts.append(failing(
        MinorityGroup("our group holds 2 of the 5 peers at our state, not a majority"),
        lambda: new.update(hash=peer.serve_next_state(delta * 0.5, contributors=["a", "b", "c"], tokens=300,
                                                      holders=["a", "b"]))))
    result = peer.sync()
    majority = new["hash"]
    assert not result.applied and result.rebased and result.outcome is Outcome.MINORITY_ADOPTED
    assert peer.hash() == majority
    assert result.error.startswith("our group holds 2 of the 5 peers")
    # our work is kept on top of the majority's state: theta = G_new - our delta
    assert torch.allclose(peer.state.params - peer.theta, delta)


def test_with_no_majority_anywhere_nobody_waits_for_a_state():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(NoMajority("our group holds 2 of the 4 peers at our state, not a majority"))
    result = peer.sync()
    assert not result.applied and not result.rebased and result.outcome is Outcome.MINORITY
    assert peer.transport.downloads == []


def test_a_missed_group_waits_for_the_next_round_then_goes_on_alone_once_stalled():
    peer = FakePeer()
    peer.train()
    holder(peer)
    for round_ in range(MAX_MISSED):
        peer.transport.scripts.append(NoGroup("could not find a group"))
        result = peer.sync()
        if round_ < MAX_MISSED - 1:  # the holder may still come: stepping alone would fork the run
            assert result.outcome is Outcome.NO_GROUP and result.error == (
                "no group formed with the 1 peer(s) at our state; retrying next round")
    assert result.outcome is Outcome.NO_GROUP  # it still votes at our state: never alone while it lives
    peer.silence("a")
    peer.transport.scripts.append(NoGroup("could not find a group"))
    holder_gone = peer.sync()
    assert holder_gone.applied and holder_gone.group == ("me",)


def test_a_missed_group_whose_holders_moved_on_is_caught_up():
    peer = FakePeer()
    delta = peer.train()
    holder(peer)
    ahead = {}  # while we waited, the holder applied the round without us
    peer.transport.scripts.append(failing(NoGroup("could not find a group"), lambda: ahead.update(
        hash=peer.serve_next_state(delta, contributors=["a"], tokens=100, holders=["a"]))))
    result = peer.sync()
    assert result.outcome is Outcome.MISSED_GROUP and result.rebased and not result.applied
    assert peer.hash() == ahead["hash"]


def test_a_peer_late_to_its_meeting_stops_waiting_once_its_window_is_over_and_the_others_applied_the_round():
    """Our group closed 0.3 s before we came, at the count its leader expected. Past our matchmaking window, the
    others' records show the round applied: the matchmaking gives up then, not a whole matchmaking timeout later (a
    peer lost 3 short rounds so), and we adopt their state with our work kept for the next round. Within the window
    the records are not read: a peer waiting there costs the DHT nothing."""
    peer = FakePeer()
    delta = peer.train()
    holder(peer, "a"), holder(peer, "b")
    before, seen = peer.hash(), {}

    def closed_without_us(transport, *_):
        seen["hash"] = peer.serve_next_state(delta, contributors=["a", "b"], tokens=200, holders=["a", "b"])
        seen["in_window"] = transport.abandon()
        peer.clock.sleep(peer.synchronizer.grace())
        seen["past_window"] = transport.abandon()
        raise NoGroup("the swarm's round ended without our group")  # as the real transport then does

    peer.transport.scripts.append(closed_without_us)
    result = peer.sync(meet_at=peer.clock.now - 0.3)
    assert (seen["in_window"], seen["past_window"]) == (False, True)
    assert result.outcome is Outcome.MISSED_GROUP and result.rebased and not result.applied
    assert peer.hash() == seen["hash"] != before
    assert torch.allclose(peer.state.params - peer.theta, delta)  # our work is kept for the next round


def test_holders_that_began_syncing_after_we_gave_up_are_joined_at_once():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([
        failing(NoGroup("could not find a group"),
                lambda: holder(peer, status=SYNCING, busy_until=peer.clock.now + 30)),  # it syncs now
        with_group(("a", theirs(peer))),
    ])
    result = peer.sync()
    assert result.applied and result.attempts == 2


def test_a_peer_that_catches_up_trains_on_until_its_holders_sync():
    peer = FakePeer()
    delta = peer.train()
    new = peer.serve_next_state(delta, contributors=["a"], tokens=100, holders=["a"])
    result = peer.sync()
    assert result.outcome is Outcome.CAUGHT_UP and result.rebased and not result.applied
    assert peer.hash() == new and peer.transport.sent == []


def test_a_peer_that_catches_up_a_moment_before_its_holders_meet_joins_them():
    """A slow peer ends its round up to one of its steps before the meeting, and catches up there. Its holders, still
    training, meet within our matchmaking window: we join them. Had we trained on, we would be one epoch behind them
    again at the next meeting (a real run's 6-s-step peers caught up 5 rounds in a row and merged nothing). Holders
    that plan to meet a round later are training on: so do we."""
    outcomes = {}
    for ahead in (1.5, 60.0):
        peer = FakePeer()
        delta = peer.train()
        new = peer.serve_next_state(delta, contributors=["a"], tokens=100, holders=["a"])
        peer.transport.peers["a"] = dataclasses.replace(peer.transport.peers["a"], next_sync_at=peer.clock.now + ahead)
        peer.transport.scripts.append(lambda t, mine, w: with_group(("a", mine))(t, mine, w))
        result = peer.sync(meet_at=peer.clock.now + 1.5)  # we are 1.5 s early: within a window of the meeting
        outcomes[ahead] = result.outcome
        assert result.rebased and peer.hash() != new if result.applied else peer.hash() == new
        assert [sent[0].hash for sent in peer.transport.sent] == ([new] if result.applied else [])
    assert outcomes == {1.5: Outcome.APPLIED, 60.0: Outcome.CAUGHT_UP}


def test_a_peer_that_catches_up_while_its_holders_sync_joins_them():
    peer = FakePeer()
    delta = peer.train()
    new = peer.serve_next_state(delta, contributors=["a"], tokens=100, holders=["a"])
    peer.transport.peers["a"] = dataclasses.replace(peer.transport.peers["a"], status=SYNCING,
                                                    busy_until=peer.clock.now + 30)
    peer.transport.scripts.append(lambda t, mine, w: with_group(("a", mine))(t, mine, w))
    result = peer.sync()
    assert result.applied and result.rebased and peer.transport.sent[0][0].hash == new


def test_records_that_come_late_do_not_make_a_peer_step_alone_until_it_is_stalled():
    peer = FakePeer()
    peer.train()
    peer.transport.late = True
    outcomes = [peer.sync().outcome for _ in range(MAX_MISSED)]
    assert outcomes == [Outcome.RECORDS_LATE] * (MAX_MISSED - 1) + [Outcome.APPLIED]


def test_a_peer_whose_reads_time_out_does_not_step_alone_on_records_that_aged_only_in_its_own_view():
    """Its groupmate was alive at the last read that answered: our reads failing since say nothing new of it. Judged
    against now, its record would go unresponsive, and a stalled peer with that empty view stepped alone (a fork,
    16 peers on a loaded machine)."""
    peer = FakePeer()
    peer.train()
    holder(peer, next_sync_at=peer.clock.now, round_seconds=5.0)  # silent past its sync by 10 s: unresponsive
    peer.synchronizer.catchup.refresh()
    peer.transport.late = True
    peer.clock.sleep(30.0)
    peer.transport.scripts.extend([NoGroup("nobody came")] * 3 * MAX_MISSED)
    before = peer.hash()
    outcomes = [peer.sync().outcome for _ in range(MAX_MISSED)]
    assert Outcome.APPLIED not in outcomes and peer.hash() == before, outcomes
    assert peer.transport.sent and all(contribution.hash == before for contribution, _, _ in peer.transport.sent)
    # once its record expires in the DHT, the peer trains on alone
    peer.clock.sleep(60.0)
    assert peer.sync().outcome is Outcome.APPLIED


def test_a_peer_that_met_others_at_its_state_does_not_step_alone_once_its_view_empties():
    """A minority group met peers at our state: a view emptied since, by reads that time out until the records we
    knew expire, says nothing of them. Counted as stalled, peers on a loaded machine stepped alone with no other
    record known, a round after their group had met 14 peers at their state (16 peers)."""
    peer = FakePeer()
    peer.train()
    peer.transport.late = True
    assert peer.sync().outcome is Outcome.RECORDS_LATE
    peer.transport.late = False
    holder(peer)
    peer.transport.scripts.append(MinorityGroup("our group holds 2 of the 15 peers at our state, not a majority"))
    assert peer.sync().outcome is Outcome.MINORITY
    peer.transport.late = True
    peer.clock.sleep(120.0)  # the holder's record, as last read, expires
    before = peer.hash()
    outcomes = [peer.sync().outcome for _ in range(MAX_MISSED)]
    # MAX_MISSED rounds that met nobody, and the escape holds again: a lone peer never blocks
    assert outcomes == [Outcome.RECORDS_LATE] * (MAX_MISSED - 1) + [Outcome.APPLIED]
    assert peer.synchronizer.stuck == 0 and peer.hash() != before


def test_a_peer_does_not_step_past_a_better_state_it_cannot_download():
    peer = FakePeer()
    peer.train()
    peer.transport.peers["x"] = record("x", 9, "ffff", 99_999)  # nobody serves it
    before = peer.hash()
    result = peer.sync()
    assert result.outcome is Outcome.PEERS_AHEAD and peer.hash() == before
    assert peer.transport.downloads == [(("x",), "ffff")]


def foreign_state(peer, epoch: int, tokens: int, holders, seed: int) -> str:
    """A state of another lineage (a fork's other half), served by ``holders``; returns its hash."""
    params = torch.randn(peer.state.params.numel(), generator=torch.Generator().manual_seed(seed))
    momentum = torch.zeros_like(params)
    digest = state_hash(params, momentum, epoch)
    peer.transport.served[digest] = (dict(epoch=epoch, tokens_total=tokens, merged={}, hash=digest),
                                     [params, momentum])
    for name in holders:
        peer.transport.peers[name] = record(name, epoch, digest, tokens)
    return digest


def test_a_peer_whose_holders_step_past_the_state_it_asks_for_downloads_where_they_went():
    """The other half of a healed split steps on while we ask for its state: each holder answers that it no longer
    holds it. A fresh look finds their new state, and we adopt that, in the same catch-up."""
    peer = FakePeer()
    peer.train()
    old = foreign_state(peer, 5, 5_000, ["a", "b"], seed=1)
    real_download = peer.transport.download
    moved = {}

    def download(donors, state_hash, timeout, part_timeout, relayed=False):
        if not moved:  # they step on as we ask: the old state is no longer served
            del peer.transport.served[old]
            moved["to"] = foreign_state(peer, 6, 6_000, ["a", "b"], seed=2)
        return real_download(donors, state_hash, timeout, part_timeout)

    peer.transport.download = download
    found = peer.catchup.catch_up(timeout=30.0)
    assert found.adopted and peer.hash() == moved["to"] and peer.state.epoch == 6
    assert [wanted for _, wanted in peer.transport.downloads] == [old, moved["to"]]


def test_peers_behind_us_are_waited_for():
    peer = FakePeer()
    peer.train()
    peer.transport.peers["b"] = record("b", 2, "bbbb", 200)
    assert peer.sync().outcome is Outcome.PEERS_BEHIND


def test_a_quorum_above_one_never_steps_alone():
    peer = FakePeer(run=RunConfig(align_every=0, quorum=2).resolved())
    peer.train()
    result = peer.sync()
    assert result.outcome is Outcome.BELOW_QUORUM and result.error == "no group of at least 2 peers formed"


def test_a_diverged_model_drops_its_work_and_restarts_from_the_global_state():
    peer = FakePeer()
    with torch.no_grad():
        peer.params[0][0] = float("nan")
    result = peer.sync()
    assert result.outcome is Outcome.DIVERGED and torch.equal(peer.theta, peer.state.params)


def test_a_group_whose_members_hold_another_state_is_not_applied():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", dataclasses.replace(theirs(peer), hash="0000"))))
    before = peer.hash()
    assert peer.sync().outcome is Outcome.STATE_MISMATCH and peer.hash() == before


def test_work_a_restart_resumed_is_dropped_when_the_swarm_merged_it_already():
    peer = FakePeer()
    delta = peer.train()
    peer.lineage.resumed_epoch = peer.state.epoch  # resumed from a checkpoint taken before its group merged it
    peer.serve_next_state(delta, contributors=["me", "a"], tokens=200, holders=["a"])
    result = peer.sync()
    assert result.outcome is Outcome.RESUMED_MERGED and not result.applied
    assert peer.lineage.take_dropped_resumed() and torch.equal(peer.theta, peer.state.params)


def test_with_overlap_the_group_ends_the_round_in_progress_together():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer, planned_end=1030.0)), ("b", theirs(peer))))
    result = peer.sync(planned_end=lambda: 1010.0)
    assert peer.transport.sent[0][0].planned_end == 1010.0  # our plan, told to the group
    assert result.round_end == 1020.0  # the median of the members' plans


def test_with_overlap_a_group_whose_syncs_outlast_its_rounds_stretches_the_next_one():
    # a thin link: each sync takes 50 s where a round is H steps at 0.5 s (planned 0.5 H seconds). Left as planned,
    # every overlapped sync would end later than the last and shorten the rounds after it
    peer = FakePeer()
    planned = peer.run.round_steps * 0.5
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([failing(GroupLostMember("sender #1 failed"), lambda: peer.clock.sleep(20.0)),
                                   with_group(("a", theirs(peer)), seconds=50.0)])
    first = peer.sync(step_seconds=0.5, planned_end=lambda: 1010.0, overlapped=True)
    assert first.applied and first.stretch == 1.0  # nobody knew how long a sync takes yet
    assert first.averaging_seconds == 50.0  # the attempt that applied: not the one that failed before it
    assert first.allreduce_seconds == 1.0  # of which the fake's all-reduce, from its group formed, took 1 s
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer, step_seconds=0.5, sync_seconds=70.0)), seconds=30.0))
    second = peer.sync(step_seconds=0.5, planned_end=lambda: 1100.0, overlapped=True)
    assert peer.transport.sent[-1][0].sync_seconds == 50.0  # our last sync's length, told to the group
    assert second.next_round_seconds == pytest.approx(min(MAX_STRETCH * planned, SYNC_HEADROOM * 60.0))
    assert second.stretch == pytest.approx(second.next_round_seconds / planned) and second.stretch > 1
    assert peer.synchronizer.meeting.sync_seconds == 40.0  # a moving average of our applied syncs' lengths


def test_a_group_waits_longer_for_its_members_where_syncs_are_long():
    # members of one all-reduce on a thin link get its last parts seconds apart, and meet again as far apart
    peer = FakePeer()
    grace = peer.run.grace_seconds
    for seconds in (2.0, 120.0, 120.0):
        peer.train()
        holder(peer)
        peer.transport.scripts.append(with_group(("a", theirs(peer)), seconds=seconds))
        peer.sync()
    assert [p["grace"] for p in peer.transport.prepared] == [grace, grace, max(grace, 0.25 * 61.0)]
    assert peer.synchronizer.round_budget() > peer.sync_config.round_budget(grace, peer.deadlines.allreduce())


def test_a_group_waits_longer_for_its_members_where_the_dht_delivers_late():
    """hivemind's matchmaking finds a group's leader through the DHT: on a machine loaded 20-fold, records came
    6-19 s late, and 5-s windows formed no group, or groups of 2-4 of 16 peers, for minutes."""
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.peers["me"] = record("me", 0, "", 0, heartbeat=2.0, updated_at=peer.clock.dht_time() - 10.0)
    peer.transport.scripts.append(with_group(("a", theirs(peer))))
    assert peer.sync().applied
    assert peer.synchronizer.cache.lag == 8.0  # our own record, read back 10 s old: 8 s beyond its heartbeat
    assert peer.transport.prepared[0]["grace"] == peer.run.grace_seconds + 8.0


def test_a_late_sync_waits_for_its_last_groupmates_to_publish_their_new_state():
    # the last sync overran the round it overlapped; b got its last parts a few seconds after us
    peer = FakePeer()
    peer.train()
    holder(peer, "a"), holder(peer, "b")
    peer.transport.scripts.append(with_group(("a", theirs(peer)), ("b", theirs(peer))))
    assert peer.sync().group == ("a", "b", "me")
    peer.train()
    holder(peer, "a")  # a published our new state; b's record still shows the old one
    reads, plain = [], peer.transport.read_records

    def read_records(timeout):
        reads.append(peer.clock.now)
        if len(reads) == 3:
            holder(peer, "b")
        return plain(timeout)

    peer.transport.read_records = read_records
    peer.transport.scripts.append(with_group(("a", theirs(peer)), ("b", theirs(peer))))
    budget = peer.synchronizer.round_budget()
    result = peer.sync(budget=budget, meet_at=peer.clock.now - 10.0)
    assert result.applied and peer.transport.prepared[-1]["expected"] == 3  # not a minority of a and us
    assert reads[2] - reads[0] == 2.0  # read every second until b was at our state
    # the wait is the sync's: counted in what it waited and in the longest it could block us
    assert result.waited == 2.0 and result.deadline == budget + 2.0


def test_without_overlap_a_sync_tells_no_length_and_rounds_keep_their_plan():
    peer = FakePeer()
    for _ in range(2):
        peer.train()
        holder(peer)
        peer.transport.scripts.append(with_group(("a", theirs(peer, step_seconds=0.5)), seconds=50.0))
        result = peer.sync(step_seconds=0.5)
    assert [sent.sync_seconds for sent, _, _ in peer.transport.sent] == [None, None]
    assert result.stretch == 1.0 and result.next_round_seconds == peer.run.round_steps * 0.5


def test_an_unreachable_holders_state_gets_one_more_attempts_time():
    peer = FakePeer()
    delta = peer.train()
    holder(peer)
    states = {}

    def finished_without_us():  # its holder does not answer yet
        states["new"] = peer.serve_next_state(delta, contributors=["me", "a"], tokens=200, holders=["a"])
        states["served"] = peer.transport.served.pop(states["new"])

    peer.transport.scripts.append(failing(MaybeApplied("lost reducer"), finished_without_us))
    downloads = []
    real_download = peer.transport.download

    def download(donors, state_hash, timeout, part_timeout, relayed=False):
        downloads.append(peer.clock.now)
        # its link comes back after the others' deadline, when the settle would have given up
        if peer.clock.now - downloads[0] > peer.run.grace_seconds + peer.deadlines.allreduce() + 5:
            peer.transport.served[states["new"]] = states["served"]
        return real_download(donors, state_hash, timeout, part_timeout)

    peer.transport.download = download
    result = peer.sync()
    assert result.outcome is Outcome.GROUP_FINISHED_WITHOUT_US and peer.hash() == states["new"]
    assert result.attempts == 2  # the settle spent the next attempt's time


def test_a_non_finite_average_is_not_applied():
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.append(with_group(("a", theirs(peer)), average=torch.full((8,), float("nan"))))
    before = peer.hash()
    result = peer.sync()
    assert result.outcome is Outcome.AVERAGE_NOT_FINITE and not result.applied and peer.hash() == before



# ---- rounds of many groups ----

def many(peer_id, numel=8):
    """A peer among 6 at its state, in groups of 2: 3 groups a round."""
    peer = FakePeer(numel=numel, run=RunConfig(align_every=0, group_size=2).resolved(), peer_id=peer_id)
    for name in ("h1", "h2", "h3", "h4", "h5"):
        holder(peer, name)
    return peer


def groupmate(peer, tokens=100):
    return theirs(peer, tokens=tokens, voters=6, groups=3, weight=float(tokens))


def test_a_delegate_averages_across_groups_and_applies_for_the_whole_swarm():
    peer = many("d")  # "d" wins the election at epoch 4 against "h1"
    peer.train()
    global_average = torch.full((8,), 0.002)
    peer.transport.scripts.extend([with_group(("h1", groupmate(peer))),
                                   across(["h2", "h3", "h4", "h5"], average=global_average)])
    expected = stepped(peer, global_average)
    result = peer.sync()
    assert result.applied and result.group == ("d", "h1", "h2", "h3", "h4", "h5")
    assert [p["phase"] for p in peer.transport.prepared] == ["group", "cross"]
    assert peer.transport.prepared[0]["expected"] == 3  # our group closes when its 3 expected members joined
    delegation, weight, _ = peer.transport.sent[1]
    assert set(delegation.members) == {"d", "h1"} and weight == delegation.weight() == 200.0
    assert torch.equal(peer.state.params, expected[0])  # the swarm's average, not our group's
    assert peer.state.tokens_total == 1000 + 100 * 6 and set(peer.state.merged) == set(result.group)


def test_a_member_takes_the_swarms_average_from_its_delegate():
    peer = many("me")
    peer.train()
    global_average = torch.full((8,), 0.003)
    peer.transport.scripts.extend([with_group(("h1", groupmate(peer))),
                                   across(["h1", "h2", "h3", "h4", "h5"], average=global_average)])
    expected = stepped(peer, global_average)
    result = peer.sync()
    assert result.applied and peer.transport.received == ["h1"] and len(peer.transport.sent) == 1
    assert torch.equal(peer.state.params, expected[0]) and len(result.group) == 6


def test_a_member_whose_delegate_is_lost_finds_the_state_it_applied_or_waits_a_round():
    peer = many("me")
    delta = peer.train()
    applied = {}

    def lost_after_applying(*_):
        applied["hash"] = peer.serve_next_state(delta, contributors=["me", "h1", "h2"], tokens=300,
                                                holders=["h1", "h2"])
        raise DelegateLost("no result from the delegate within 30.0s")

    peer.transport.scripts.extend([with_group(("h1", groupmate(peer))), lost_after_applying])
    result = peer.sync()
    assert result.outcome is Outcome.GROUP_FINISHED_WITHOUT_US and peer.hash() == applied["hash"]

    quiet = many("me")
    quiet.train()
    theta = quiet.theta
    quiet.transport.scripts.extend([with_group(("h1", groupmate(quiet))), DelegateLost("it gave up")])
    result = quiet.sync()
    assert result.outcome is Outcome.DELEGATE_LOST and not result.applied
    assert result.error == "our group's delegate brought no result (it gave up); contributing next round"
    assert torch.equal(quiet.theta, theta)  # our work stays, for the next round


def test_a_result_that_did_not_merge_our_delta_is_not_applied():
    # our delegate's side of our group's all-reduce failed; it met a later group of its own and crossed for that
    peer = many("me")
    peer.train()
    theta = peer.theta
    peer.transport.scripts.extend([with_group(("h1", groupmate(peer))),
                                   across(["h1", "h2", "h3", "h4", "h5"], average=torch.full((8,), 0.003),
                                          without="me")])
    result = peer.sync()
    assert result.outcome is Outcome.DELEGATE_LOST and not result.applied
    assert "did not merge our delta" in result.error and torch.equal(peer.theta, theta)


def test_a_late_groups_delegate_stops_waiting_once_the_swarm_moved_on_and_catches_up_keeping_its_work():
    """Our group came late to the round: the other groups' delegates crossed without it and the swarm is one epoch
    on. The delegate's matchmaking, asking as it waits, gives up at once, and it adopts the new state, rebased onto
    it with our work kept for the next round; our groupmates stop waiting for its result."""
    peer = many("d")
    delta = peer.train()
    before, seen = peer.hash(), {}

    def the_others_applied_without_us(transport, *_):
        seen["before"] = transport.abandon()  # nobody is ahead yet: keep waiting
        seen["hash"] = peer.serve_next_state(torch.full((8,), 0.001), contributors=["h2", "h3", "h4", "h5"],
                                             tokens=400, holders=["h2", "h3", "h4", "h5"])
        seen["after"] = transport.abandon()
        raise NoGroup("the swarm's round ended without our group")  # as the real transport then does

    peer.transport.scripts.extend([with_group(("h1", groupmate(peer))), the_others_applied_without_us])
    result = peer.sync()
    assert (seen["before"], seen["after"]) == (False, True)
    assert result.outcome is Outcome.MISSED_GROUP and result.rebased and not result.applied
    assert peer.hash() == seen["hash"] != before
    assert torch.allclose(peer.state.params - peer.theta, delta)  # theta = G_new - our delta: our work is kept
    assert peer.transport.given_up == [(4, before)]


def test_a_cross_group_retry_starts_from_the_groups_average_and_a_delegate_that_gives_up_says_so():
    peer = many("d")
    peer.train()
    group_average = torch.full((8,), 0.01)
    seen = []

    def lost_member_after_writing(transport, *_):
        seen.append(transport.tensors[0].clone())
        transport.tensors[0].fill_(123.0)  # a failed all-reduce may leave a partial average behind
        raise GroupLostMember("lost reducer")

    def check_then_fail(transport, *_):
        seen.append(transport.tensors[0].clone())
        raise NoGroup("could not find a group")

    peer.transport.scripts.extend([with_group(("h1", groupmate(peer)), average=group_average),
                                   lost_member_after_writing, check_then_fail])
    result = peer.sync()
    assert all(torch.equal(t, group_average) for t in seen) and len(seen) == 2
    assert result.outcome is Outcome.NO_OTHER_GROUPS and not result.applied
    assert peer.transport.given_up == [(4, peer.hash())]  # its groupmates stop waiting


def test_a_majority_group_whose_delegate_meets_no_other_applies_on_its_own():
    peer = many("d")
    peer.train()
    group_average = torch.full((8,), 0.005)
    big = [(name, groupmate(peer)) for name in ("h1", "h2", "h3")]
    peer.transport.scripts.extend([with_group(*big, average=group_average), NoGroup("could not find a group")])
    expected = stepped(peer, group_average)
    result = peer.sync()
    assert result.applied and len(result.group) == 4 and torch.equal(peer.state.params, expected[0])
    assert [p["phase"] for p in peer.transport.prepared] == ["group", "cross"]
    assert peer.transport.concluded == [(4, peer.transport.prepared[0]["hash"], ("d", "h1", "h2", "h3"))]


def test_a_peer_left_over_when_the_groups_filled_keeps_its_work_for_the_next_round():
    # across, it would take a planned group's place: the cross-group round closes at the planned count of groups
    peer = many("me")
    peer.train()
    theta = peer.theta
    peer.transport.scripts.extend([NoGroup("could not find a group")])
    result = peer.sync()
    assert not result.applied and [p["phase"] for p in peer.transport.prepared] == ["group"]
    assert result.outcome is Outcome.NO_GROUP and torch.equal(peer.theta, theta)


def test_a_look_between_inner_steps_does_not_wait_and_an_unanswered_poll_is_no_failed_read():
    """``RoundClock.watch`` polls the records (``StateCatchUp.refresh(poll=True)``): a lookup not answered yet leaves
    what we knew as it was, and is not a read that timed out (which would age every record as of the last answer)."""
    peer = FakePeer()
    peer.train()
    holder(peer, next_sync_at=peer.clock.now + 30.0, round_seconds=5.0)
    catchup = peer.synchronizer.catchup
    known = catchup.refresh()
    assert known and not peer.synchronizer.cache.lookup_failed
    peer.transport.late = True  # the lookup has not answered
    assert catchup.refresh(poll=True) == known and not peer.synchronizer.cache.lookup_failed
    assert catchup.refresh() == known and peer.synchronizer.cache.lookup_failed  # a read that waited and timed out


def test_the_real_transport_polls_a_running_all_reduce_until_it_ends(monkeypatch):
    """``SwarmTransport.average`` waits for hivemind's step in polls, asking between them whether to give up. A poll
    that times out raises concurrent.futures' TimeoutError, which before Python 3.11 is not the builtin one: there
    the first poll raised out of the sync, after a second, and every longer matchmaking failed."""
    class Control(concurrent.futures.Future):  # hivemind's StepControl, as the poll sees it
        began_allreduce = False

    control, polls = Control(), []

    def abandon() -> bool:
        polls.append(len(polls))
        if len(polls) == 2:
            control.set_result("averaged")
        return False

    monkeypatch.setattr(real, "ABANDON_POLL", 0.01)
    transport = object.__new__(real.SwarmTransport)
    alive = [True]
    transport.averager = SimpleNamespace(step=lambda **_: control, matchmaking_kwargs=dict(request_timeout=1.0),
                                         is_alive=lambda: alive[0])
    transport.dht = SimpleNamespace(link_lost=lambda: None)
    transport.meet_at, transport.grace, transport.phase = None, 1.0, real.GROUP
    word = SimpleNamespace(to_wire=lambda: {})
    assert transport.average(word, 1.0, timeout=30.0, abandon=abandon) == "averaged" and len(polls) == 2
    # an averager process that died mid all-reduce resolves nothing: the next poll says so, not the deadline
    control, alive[0] = Control(), False
    with pytest.raises(LinkLost, match="averaging process died"):
        transport.average(word, 1.0, timeout=30.0)


def died(part="averaging process"):
    """An attempt under which a helper process of ours dies (the kernel's OOM killer, a stray pkill)."""
    def run(transport, *_):
        transport.lost = part_died(part)
        raise LinkLost(transport.lost)

    return run


def test_a_helper_that_dies_mid_all_reduce_ends_the_sync_at_once_unapplied():
    # nobody hears us now: no retry, nothing applied, the work still pending (the peer leaves, checkpointed)
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.scripts.extend([died(), with_group(("a", theirs(peer)))])
    before, theta = peer.state.params.clone(), peer.theta
    result = peer.sync()
    assert not result.applied and result.outcome is Outcome.LINK_LOST and result.attempts == 1
    assert result.error.startswith("this node's averaging process died")
    assert len(peer.transport.scripts) == 1  # the retry never ran
    assert torch.equal(peer.state.params, before) and torch.equal(peer.theta, theta) and peer.state.epoch == 4


def test_a_link_lost_before_or_during_a_download_ends_the_sync_without_averaging(monkeypatch):
    peer = FakePeer()
    peer.train()
    holder(peer)
    peer.transport.lost = part_died("p2p daemon")  # the daemon died between two syncs: nothing raises
    result = peer.sync()
    assert result.outcome is Outcome.LINK_LOST and "p2p daemon died" in result.error
    assert not peer.transport.prepared and not peer.transport.sent
    # a peer behind the swarm whose averager dies under the state's download, before any view of the sync
    peer.transport.lost = None
    peer.transport.peers.clear()
    ours = peer.hash()
    peer.serve_next_state(torch.full((8,), 0.01), contributors=["a"], tokens=100, holders=["a"])
    asked = []
    monkeypatch.setattr(peer.transport, "download", lambda *args, **_: asked.append(args) or died()(peer.transport))
    result = peer.sync()
    assert result.outcome is Outcome.LINK_LOST and "averaging process died" in result.error
    assert len(asked) == 1 and peer.hash() == ours and not peer.transport.sent  # asked once, then nothing more


def test_a_lone_step_applied_before_the_averager_died_under_its_serving_stands(monkeypatch):
    # the step is in the state already; only its serving, for a peer behind to replay, met the dead averager
    peer = FakePeer()
    delta = peer.train()
    peer.transport.peers["b"] = record("b", 4, peer.hash(), 1000)
    peer.silence("b")
    expected = stepped(peer, delta)
    monkeypatch.setattr(peer.transport, "serve_alone", lambda *_: died()(peer.transport))
    result = peer.sync(tokens=100)
    assert result.applied and result.outcome is Outcome.APPLIED and result.group == ("me",)
    assert torch.equal(peer.state.params, expected[0]) and peer.state.epoch == 5
