"""Fork choice, expected groups, the majority rule and round targets over peer records; no DHT."""

import dataclasses
import logging

from dht.records import CLOCK_SLACK, HEARTBEAT_MISSES, PeerRecord
from peer.swarm.consensus import (
    MAX_MISSED,
    SILENCE_SLACK,
    awaiting_state,
    catching_up,
    choose_state,
    joining,
    majority_elsewhere,
    minority,
    peers_ahead,
    peers_behind,
    peers_with_state,
    responsive,
    syncing_now,
    voters,
)
from peer.swarm.metadata import Contribution
from peer.swarm.records import RecordCache
from peer.swarm.timing import LATE_HEADROOM, MAX_STRETCH, SYNC_HEADROOM, next_round, round_target


def record(peer, epoch, state_hash, tokens, manifest="m", status="training", next_sync_at=None):
    return PeerRecord(peer_id=peer, epoch=epoch, state_hash=state_hash, tokens_total=tokens, manifest_hash=manifest,
                      status=status, next_sync_at=next_sync_at)


def test_most_tokens_win():
    mine = record("me", 5, "aa", 100)
    assert choose_state([record("x", 5, "bb", 200)], mine).state_hash == "bb"
    assert choose_state([record("x", 4, "bb", 50)], mine) is None


def test_ties_go_to_the_lowest_hash_for_everyone():
    a, b = record("a", 5, "0f", 100), record("b", 5, "f0", 100)
    assert choose_state([b], a) is None
    assert choose_state([a], b).state_hash == "0f"


def test_other_runs_and_departed_peers_are_ignored():
    mine = record("me", 1, "aa", 10)
    others = [record("x", 9, "bb", 999, manifest="other"), record("y", 9, "cc", 999, status="left")]
    assert choose_state(others, mine) is None


def test_peers_with_state_are_those_at_our_exact_state():
    mine = record("me", 3, "aa", 10)
    others = [record("a", 3, "aa", 10), record("b", 3, "ab", 10), record("c", 2, "aa", 5), record("me", 3, "aa", 10)]
    assert [r.peer_id for r in peers_with_state(others, mine)] == ["a"]


def test_round_target_is_the_median_of_future_plans():
    mine = record("me", 3, "aa", 10)
    others = [record(p, 3, "aa", 10, next_sync_at=t) for p, t in (("a", 110.0), ("b", 120.0), ("c", 90.0))]
    assert round_target(others, mine, own_plan=130.0, now=100.0) == 120.0  # c's plan is already past
    assert round_target(others, mine, own_plan=None, now=100.0) == 115.0
    assert round_target([], mine, own_plan=None, now=100.0) is None


def test_the_next_round_outlasts_the_members_syncs_within_a_bound():
    def group(*syncs, pace=0.5):
        return {f"p{i}": Contribution(epoch=1, hash="aa", tokens=1, step_seconds=pace, sync_seconds=s)
                for i, s in enumerate(syncs)}
    assert next_round(group(None, None), round_seconds=0, inner_steps=100) == (50.0, 1.0)  # H at the median pace
    assert next_round(group(10.0, 20.0, 30.0), round_seconds=0, inner_steps=100) == (50.0, 1.0)  # syncs fit
    seconds, stretch = next_round(group(40.0, 60.0, 200.0), round_seconds=0, inner_steps=100)
    assert seconds == SYNC_HEADROOM * 60.0 and stretch == seconds / 50.0  # the median sync, with headroom
    assert next_round(group(900.0), round_seconds=30.0, inner_steps=100) == (MAX_STRETCH * 30.0, MAX_STRETCH)
    assert next_round(group(60.0, pace=None), round_seconds=0, inner_steps=100) == (None, 1.0)  # no pace known


def test_while_a_peer_catches_up_the_next_round_also_leaves_it_a_sync_to_replay_the_result():
    def group(*lates, syncs=(14.0, 17.0, 20.0)):
        return {f"p{i}": Contribution(epoch=5, hash="aa", tokens=1, step_seconds=1.0, sync_seconds=s, late=late)
                for i, (s, late) in enumerate(zip(syncs, lates))}
    assert next_round(group(0, 0, 0), round_seconds=15.0, inner_steps=15) == (SYNC_HEADROOM * 17.0,
                                                                               SYNC_HEADROOM * 17.0 / 15.0)
    seconds, stretch = next_round(group(0, 1, 0), round_seconds=15.0, inner_steps=15)  # one member sees one
    assert seconds == LATE_HEADROOM * 17.0 and stretch == seconds / 15.0
    # a link fast enough that a round already leaves that time: nothing changes
    assert next_round(group(1, 1, 1, syncs=(5.0, 6.0, 7.0)), round_seconds=60.0, inner_steps=60) == (60.0, 1.0)
    assert next_round(group(1, 1, 1, syncs=(100.0,) * 3), round_seconds=15.0, inner_steps=15) == \
        (MAX_STRETCH * 15.0, MAX_STRETCH)  # still within the bound
    wire = Contribution.from_wire(group(2)["p0"].to_wire())
    assert wire.late == 2 and Contribution.from_wire({"epoch": 5, "hash": "aa", "tokens": 1}).late == 0


def test_catching_up_are_live_peers_an_epoch_or_two_behind_that_did_not_produce_our_state():
    mine = record("me", 7, "aa", 10)
    others = [record("missed", 6, "bb", 9, next_sync_at=100.0), record("groupmate", 6, "bb", 9, next_sync_at=100.0),
              record("two", 5, "cc", 8), record("far", 2, "dd", 5), record("dead", 6, "bb", 9, next_sync_at=50.0),
              record("ahead", 8, "ee", 11), record("holder", 7, "aa", 10)]
    late = catching_up(others, mine, now=100.0, producers=["groupmate", "holder"])
    assert sorted(r.peer_id for r in late) == ["missed", "two"]  # "far" downloads the state; "dead" is silent


def test_a_peer_silent_long_past_its_planned_sync_is_not_waited_for():
    mine = record("me", 3, "aa", 10)
    quiet = [record("a", 3, "aa", 10, next_sync_at=100.0), record("b", 2, "bb", 5, next_sync_at=100.0)]
    assert [r.peer_id for r in peers_behind(quiet, mine, now=105.0)] == ["b"]  # a little late: waited for
    assert peers_behind(quiet, mine, now=100.0 + SILENCE_SLACK + 1) == []  # frozen, dead or cut off
    busy = [record("b", 2, "bb", 5, next_sync_at=100.0)]
    busy[0] = dataclasses.replace(busy[0], busy_until=200.0)  # in a long sync: alive
    assert len(peers_behind(busy, mine, now=150.0)) == 1


def test_a_peer_whose_heartbeat_stopped_is_gone_within_seconds():
    mine = record("me", 3, "aa", 10)
    # planned to sync far ahead: only the heartbeat can tell that it died
    beating = dataclasses.replace(record("a", 3, "aa", 10, next_sync_at=500.0), heartbeat=2.0, updated_at=100.0)
    read = dataclasses.replace(beating, seen_at=105.0)  # read 5 s after its last refresh
    assert responsive(read, now=105.0) and [r.peer_id for r in peers_with_state([read], mine, now=105.0)] == ["a"]
    assert responsive(read, now=300.0)  # our copy aged, but when we read it the peer was alive: not evidence
    stale = dataclasses.replace(beating, seen_at=100.0 + HEARTBEAT_MISSES * 2.0 + CLOCK_SLACK + 0.1)
    assert not responsive(stale, now=stale.seen_at) and peers_with_state([stale], mine, now=stale.seen_at) == []
    assert voters([stale], mine, now=stale.seen_at) == 1
    legacy = dataclasses.replace(record("b", 3, "aa", 10, next_sync_at=500.0), seen_at=300.0)  # no heartbeat
    assert responsive(legacy, now=300.0)  # promises no heartbeat: judged by its plan alone


def test_a_slow_dht_that_delays_our_own_record_as_much_does_not_silence_the_others():
    """Heartbeats that land 20 s late land late for everyone: read with our own record as stale, the others are
    alive. A peer cut off from them reads its own record fresh, and they go silent."""
    mine = record("me", 3, "aa", 10)

    def read(own_age, their_age, now=1000.0):
        def seen(peer, age):
            return dataclasses.replace(record(peer, 3, "aa", 10, next_sync_at=now - age + 5.0), heartbeat=2.0,
                                       updated_at=now - age, seen_at=now, expires_at=now + 60.0)
        cache = RecordCache("me")
        others = cache.update({"me": seen("me", own_age), "a": seen("a", their_age), "b": seen("b", their_age)}, now)
        return cache, others

    cache, others = read(own_age=22.0, their_age=22.0)  # the DHT delivers everything 20 s late
    assert cache.lag == 20.0 and voters(others.values(), mine, now=cache.as_of(1000.0)) == 3
    cache, others = read(own_age=1.0, their_age=22.0)  # we are cut off from them: they are silent
    assert cache.lag == 0.0 and voters(others.values(), mine, now=cache.as_of(1000.0)) == 1
    # judged as of the lag, a peer that planned to sync 5 s after its last heartbeat is not yet past its plan
    cache, others = read(own_age=40.0, their_age=40.0)
    assert all(responsive(r, cache.as_of(1000.0)) for r in others.values())
    assert not all(responsive(r, 1000.0) for r in others.values())


def test_the_dhts_lag_rises_at_once_falls_halfway_per_read_and_is_said_once_each_way(caplog):
    """Under load, reads found our own record 8 s late, then on time, over and over: the log said so at every read,
    and others' records swung with it."""
    cache = RecordCache("me")

    def read(own_age, now=1000.0):
        own = dataclasses.replace(record("me", 3, "aa", 10), heartbeat=2.0, updated_at=now - own_age, seen_at=now,
                                  expires_at=now + 60.0)
        cache.update({"me": own}, now)
        return cache.lag

    with caplog.at_level(logging.INFO, logger="peer.swarm.records"):
        assert [read(22.0), read(2.0), read(12.0), read(2.0), read(2.0), read(2.0)] == [20.0, 10.0, 10.0, 5.0, 2.5,
                                                                                      1.25]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "20 s late" in said[0] and said[1] == "the DHT delivers records on time again"


def test_voters_are_the_responsive_peers_at_our_state_and_those_that_produced_it():
    mine = record("me", 3, "aa", 10)
    others = [record("a", 3, "aa", 10, next_sync_at=100.0), record("frozen", 3, "aa", 10, next_sync_at=50.0),
              record("b", 3, "ab", 10, next_sync_at=100.0)]
    assert voters(others, mine, now=55.0) == 3  # me, a, and frozen until it is SILENCE_SLACK late
    assert voters(others, mine, now=50.0 + SILENCE_SLACK + 1) == 2
    # a peer that just caught up sees the older records of the group that produced its state: they count, or
    # 2 of 5 would look a majority
    lagging = [record(p, 2, "old", 8, next_sync_at=100.0) for p in ("c", "d", "e")]
    assert voters([record("f", 3, "aa", 10, next_sync_at=100.0), *lagging], mine, now=55.0,
                  producers=["c", "d", "e", "f"]) == 5
    # the other half of a partition (not among our state's producers) does not: each half trains on
    assert voters(lagging, mine, now=55.0, producers=["me", "f"]) == 1


def test_of_two_groups_split_from_one_state_only_the_majority_applies():
    def group(size, electorate, missed=0):
        return {f"p{i}": Contribution(epoch=0, hash="h", tokens=1, voters=electorate, missed=missed)
                for i in range(size)}

    assert minority(group(3, 5)) is None
    assert minority(group(2, 5)) == "our group holds 2 of the 5 peers at our state, not a majority"
    assert minority(group(2, 4)) is not None and minority(group(2, 3)) is None  # a 2|2 split: neither, this round
    assert minority(group(1, 1)) is None
    assert majority_elsewhere(group(2, 5)) and not majority_elsewhere(group(2, 4))  # 2|2: nobody applies, no wait
    assert minority(group(2, 4, missed=MAX_MISSED - 1)) is None  # two minorities must not stall forever
    # with a majority possible elsewhere (it may be retrying the round), a lagging member's misses wait longer
    assert minority(group(2, 5, missed=MAX_MISSED - 1)) is not None
    assert minority(group(2, 5, missed=2 * MAX_MISSED - 1)) is None
    mixed = group(2, 3)
    # members counted differently: the largest count rules, for every member alike
    mixed["p0"] = dataclasses.replace(mixed["p0"], voters=5)
    assert minority(mixed) is not None


def test_a_leaving_peer_waits_only_for_peers_that_could_get_its_state_from_nobody_else():
    mine = record("me", 5, "aa", 50)
    behind, ahead = record("b", 4, "old", 40, next_sync_at=100.0), record("c", 6, "new", 60, next_sync_at=100.0)
    rival = record("r", 5, "ab", 60, next_sync_at=100.0)  # a fork with more tokens: it wins, and stays on its own
    assert awaiting_state([behind, ahead, rival], mine, now=95.0) == ["b"]  # c is past us: it needs nothing from us
    holder = record("h", 5, "aa", 50, next_sync_at=100.0)
    assert awaiting_state([behind, holder], mine, now=95.0) == []  # h stays and serves b
    assert awaiting_state([behind, dataclasses.replace(holder, status="leaving")], mine, now=95.0) == ["b"]
    assert awaiting_state([behind, dataclasses.replace(holder, client_mode=True)], mine, now=95.0) == ["b"]
    assert awaiting_state([behind], mine, now=100.0 + SILENCE_SLACK + 1) == []  # dead or frozen: not waited for


def test_a_peer_without_a_group_does_not_step_alone_while_a_live_peer_is_ahead():
    mine = record("me", 11, "aa", 110)
    ahead = record("a", 13, "cc", 130, next_sync_at=100.0)
    assert [r.peer_id for r in peers_ahead([ahead, record("b", 10, "bb", 100, next_sync_at=100.0)], mine,
                                           now=95.0)] == ["a"]
    assert peers_ahead([ahead], mine, now=100.0 + SILENCE_SLACK + 1) == []  # cut off or dead: we train on alone
    assert peers_ahead([dataclasses.replace(ahead, status="left")], mine, now=95.0) == []


def test_a_peer_downloading_our_state_is_expected_and_joins_holders_that_are_syncing_it():
    """The lag loop: a late peer's download took as long as a round, and every group closed before it ended."""
    now = 1000.0
    mine = record("me", 5, "aa", 100)
    late = dataclasses.replace(record("late", 3, "cc", 60), adopting="aa")
    elsewhere = dataclasses.replace(record("other", 3, "cc", 60), adopting="dd")
    assert [r.peer_id for r in joining([late, elsewhere], mine, now)] == ["late"]
    assert joining([dataclasses.replace(late, epoch=5, state_hash="aa")], mine, now) == []  # holds it: counted so
    # once it holds the state: are its holders in a sync now (matchmaking or all-reduce)?
    syncing = dataclasses.replace(record("x", 5, "aa", 100, status="syncing", next_sync_at=now - 1), busy_until=now + 5)
    assert [r.peer_id for r in syncing_now([syncing], mine, now)] == ["x"]
    assert syncing_now([dataclasses.replace(syncing, busy_until=now - 1)], mine, now) == []  # that sync is over
    assert syncing_now([record("y", 5, "aa", 100, next_sync_at=now + 3)], mine, now) == []  # training
    assert syncing_now([dataclasses.replace(syncing, state_hash="bb")], mine, now) == []  # another state
