"""Every outcome of the round's decision, as a pure function of a typed view: no network, no tensors, no time."""

import collections
import dataclasses

import pytest

from dht.records import PeerRecord
from peer.round.decide import Action, Do, Failure, Phase, View, decide, settle_longer
from peer.round.outcomes import Outcome, describe
from peer.swarm import grouping
from peer.swarm.consensus import MAX_MISSED, SYNCING
from peer.swarm.failures import NoMajority
from peer.swarm.grouping import delegate, group_count, plan, union
from peer.swarm.metadata import Contribution, Delegation

NOW = 1000.0
MINE = PeerRecord(peer_id="me", epoch=5, state_hash="aa", tokens_total=500, manifest_hash="m")


def peer(name, epoch=5, state="aa", tokens=500, **fields):
    """A live peer's record, as read just now."""
    return PeerRecord(peer_id=name, epoch=epoch, state_hash=state, tokens_total=tokens, manifest_hash="m",
                      heartbeat=2.0, updated_at=NOW, seen_at=NOW, **fields)


def view(phase, *records, **facts):
    return View(phase=phase, mine=MINE, records=tuple(records), now=NOW, quorum=1, retries=2, **facts)


def test_begin():
    assert decide(view(Phase.BEGIN, dropped_resumed=True)) == Action(Do.FINISH, Outcome.RESUMED_MERGED)
    assert decide(view(Phase.BEGIN)) == Action(Do.ATTEMPT)
    # just caught up: ask whether the holders of the adopted state are syncing now
    assert decide(view(Phase.BEGIN, caught_up=True)) == Action(Do.LOOK_AT_HOLDERS)
    assert decide(view(Phase.BEGIN, caught_up=True, holders_syncing=False)) == Action(Do.FINISH, Outcome.CAUGHT_UP)
    # they are: join them, and the deltas carried from the fork we just left go out with this attempt
    assert decide(view(Phase.BEGIN, caught_up=True, holders_syncing=True)) == Action(Do.ATTEMPT, send_carried=True)
    assert decide(view(Phase.BEGIN, time_left=0.0)).do is Do.FINISH


def test_ready_with_peers_at_our_state_averages_with_them_and_those_downloading_it():
    client = peer("c", client_mode=True)
    action = decide(view(Phase.READY, peer("a"), client, peer("j", epoch=4, state="zz", tokens=100, adopting="aa"),
                         peer("old", epoch=4, state="zz", tokens=100)))
    assert action.do is Do.AVERAGE and action.expected == 4  # us, a, c and the joiner
    assert action.probe == ("a",)  # clients cannot be dialled
    assert set(action.members) == {"a", "c", "j"}  # yet they are the group's members: their places are kept
    assert action.voters == 3  # us and the two at our state; neither the joiner nor the peer behind votes


def test_a_group_closes_at_its_windows_end_only_as_a_majority_unless_we_are_stalled():
    holders = [peer(f"h{i}") for i in range(5)]  # 6 voters: a group of 3 would be refused as a minority
    assert decide(view(Phase.READY, *holders)).min_group == 4
    # stalled, a minority may apply (consensus.minority), so it must be able to form: the quorum's floor again
    assert decide(view(Phase.READY, *holders, stuck=MAX_MISSED - 1)).min_group == 0
    # a group of a round of many closes with most of the members it expects: two late ones form no group of their
    # own (its delegate would take a real group's place in the cross-group round)
    action = decide(dataclasses.replace(view(Phase.READY, *holders), group_size=2))
    assert action.groups > 1 and action.min_group == action.target // 2 + 1
    # never more than the group we expect (a producer that votes but does not meet with us)
    assert decide(view(Phase.READY, peer("a"), peer("p", epoch=4, state="zz"), producers=("p",))).min_group == 2


def test_producers_vote_whatever_epoch_their_record_shows():
    producer = peer("p", epoch=4, state="zz", tokens=100)
    assert decide(view(Phase.READY, peer("a"), producer, producers=("p",))).voters == 3


def test_the_producers_of_our_state_are_expected_while_their_records_still_show_the_epoch_before():
    # they applied the outer step that made our state: counting only the records that show it, a leader on a late
    # DHT closed its group at the 7 of 15 it saw, a minority
    late = [peer(f"p{i}", epoch=4, state="zz", tokens=100) for i in range(3)]
    action = decide(view(Phase.READY, peer("a"), *late, producers=("a", "p0", "p1", "p2")))
    assert (action.do, action.expected, action.target, action.voters) == (Do.AVERAGE, 5, 5, 5)
    assert action.probe == ("a", "p0", "p1", "p2") and action.min_group == 3
    # alone at our state by the records: we wait for them instead of telling them to catch up with us
    assert decide(view(Phase.READY, *late, producers=("p0", "p1", "p2"))).target == 4
    # a producer downloading our state counts once; one ahead of us, or dead, or not a producer, not at all
    joiner = peer("p0", epoch=4, state="zz", tokens=100, adopting="aa")
    ahead = peer("p1", epoch=6, state="cc", tokens=900)
    dead = dataclasses.replace(peer("p2", epoch=4, state="zz", tokens=100), updated_at=NOW - 60.0)
    stranger = peer("s", epoch=4, state="zz", tokens=100)
    action = decide(view(Phase.READY, peer("a"), joiner, ahead, dead, stranger, producers=("a", "p0", "p1", "p2")))
    assert (action.expected, action.target) == (3, 3)


def test_ready_alone():
    assert decide(view(Phase.READY)) == Action(Do.STEP_ALONE)
    assert decide(view(Phase.READY, finite=False)) == Action(Do.FINISH, Outcome.DIVERGED)
    # a late read of the records may be empty only because it is late: wait, until stalled
    assert decide(view(Phase.READY, lookup_failed=True)) == Action(Do.FINISH, Outcome.RECORDS_LATE)
    assert decide(view(Phase.READY, lookup_failed=True, lonely=MAX_MISSED - 1)) == Action(Do.STEP_ALONE)
    # the others are behind: they join us next round
    behind = peer("b", epoch=3, state="bb", tokens=300)
    assert decide(view(Phase.READY, behind)) == Action(Do.FINISH, Outcome.PEERS_BEHIND, count=1)
    assert decide(view(Phase.READY, behind, lonely=MAX_MISSED - 1)) == Action(Do.STEP_ALONE)
    # a live peer holds a better state (its download failed): never step alone, even stalled
    ahead = peer("x", epoch=6, state="cc", tokens=900)
    assert decide(view(Phase.READY, ahead, lonely=MAX_MISSED)) == Action(Do.FINISH, Outcome.PEERS_AHEAD, count=1)
    assert decide(dataclasses.replace(view(Phase.READY), quorum=2)) == Action(Do.FINISH, Outcome.BELOW_QUORUM,
                                                                              count=2)


def test_a_dead_peer_at_our_state_is_not_expected():
    dead = dataclasses.replace(peer("d"), updated_at=NOW - 60.0)  # its heartbeats stopped a minute ago
    assert decide(view(Phase.READY, dead)) == Action(Do.STEP_ALONE)


def test_failed_attempts_by_type():
    failed = dict(expected=3)
    assert decide(view(Phase.FAILED, failure=Failure.MINORITY, **failed)) == Action(Do.SETTLE)
    assert decide(view(Phase.FAILED, failure=Failure.NO_MAJORITY, **failed)) == Action(Do.FINISH, Outcome.MINORITY)
    assert decide(view(Phase.FAILED, failure=Failure.MAYBE_APPLIED, **failed)) == Action(Do.SETTLE,
                                                                                        Outcome.LOST_MEMBER)
    assert decide(view(Phase.FAILED, failure=Failure.NO_GROUP, **failed)) == Action(Do.CATCH_UP)


def test_a_lost_member_is_retried_with_fresh_records_while_attempts_and_time_remain():
    lost = dict(failure=Failure.LOST_MEMBER, expected=3)
    assert decide(view(Phase.FAILED, attempts=1, **lost)) == Action(Do.ATTEMPT, Outcome.LOST_MEMBER, refresh=True)
    assert decide(view(Phase.FAILED, attempts=3, **lost)) == Action(Do.FINISH, Outcome.LOST_MEMBER)
    assert decide(view(Phase.FAILED, attempts=1, time_left=-0.1, **lost)) == Action(Do.FINISH, Outcome.LOST_MEMBER)


def test_settled():
    minority = dict(failure=Failure.MINORITY, attempts=1)
    assert decide(view(Phase.SETTLED, settled=True, **minority)) == Action(Do.FINISH, Outcome.MINORITY_ADOPTED)
    assert decide(view(Phase.SETTLED, settled=False, **minority)) == Action(Do.FINISH, Outcome.MINORITY)
    maybe = dict(failure=Failure.MAYBE_APPLIED, attempts=1)
    assert decide(view(Phase.SETTLED, settled=True, merged_ours=True, **maybe)) == Action(
        Do.FINISH, Outcome.GROUP_FINISHED_WITHOUT_US)
    # a state appeared without our delta, or none did: average again (from the state we hold now)
    assert decide(view(Phase.SETTLED, settled=True, merged_ours=False, **maybe)) == Action(Do.ATTEMPT, refresh=True)
    assert decide(view(Phase.SETTLED, settled=False, **maybe)) == Action(Do.ATTEMPT, refresh=True)
    assert decide(view(Phase.SETTLED, settled=False, attempts=3, failure=Failure.MAYBE_APPLIED)).do is Do.FINISH


def test_after_a_missed_group():
    missed = dict(failure=Failure.NO_GROUP, expected=3, attempts=1)
    assert decide(view(Phase.CAUGHT_UP, caught_up=True, **missed)) == Action(Do.FINISH, Outcome.MISSED_GROUP)
    assert decide(view(Phase.CAUGHT_UP, caught_up=False, **missed)) == Action(Do.LOOK_AT_HOLDERS)
    # the holders began their sync after our matchmaking gave up on them: retry at once, on the records just read
    assert decide(view(Phase.CAUGHT_UP, caught_up=False, holders_syncing=True, records_fresh=True, **missed)) == \
        Action(Do.ATTEMPT)
    holder = peer("a")
    assert decide(view(Phase.CAUGHT_UP, holder, caught_up=False, holders_syncing=False, **missed)) == Action(
        Do.FINISH, Outcome.NO_GROUP, count=2)
    # stalled, and nobody else votes at our state: go on alone
    assert decide(view(Phase.CAUGHT_UP, caught_up=False, holders_syncing=False, lonely=MAX_MISSED - 1,
                       **missed)) == Action(Do.STEP_ALONE)
    assert decide(view(Phase.CAUGHT_UP, holder, caught_up=False, holders_syncing=False, lonely=MAX_MISSED - 1,
                       **missed)).outcome is Outcome.NO_GROUP
    # out of attempts: the holders are not asked
    out = dict(missed, attempts=3)
    assert decide(view(Phase.CAUGHT_UP, holder, caught_up=False, **out)).outcome is Outcome.NO_GROUP


def test_averaged():
    ours = Contribution(epoch=5, hash="aa", tokens=100)
    assert decide(view(Phase.AVERAGED, gathered={"me": ours, "a": ours})) == Action(Do.APPLY)
    other = dataclasses.replace(ours, hash="bb")
    assert decide(view(Phase.AVERAGED, gathered={"me": ours, "a": other})) == Action(Do.FINISH,
                                                                                   Outcome.STATE_MISMATCH)


def test_holders_syncing_now_is_read_from_their_records():
    from peer.round.decide import holders_syncing

    assert holders_syncing(view(Phase.BEGIN, peer("a", status=SYNCING, busy_until=NOW + 5)))
    assert not holders_syncing(view(Phase.BEGIN, peer("a", status=SYNCING, busy_until=NOW - 5)))
    assert not holders_syncing(view(Phase.BEGIN, peer("a", epoch=6, state="cc", status=SYNCING, busy_until=NOW + 5)))


def test_a_settle_takes_one_more_attempt_only_for_a_state_it_saw_but_could_not_download():
    assert settle_longer(extended=False, unreachable=True, attempts=1, retries=2, time_left=5.0)
    assert not settle_longer(extended=True, unreachable=True, attempts=1, retries=2, time_left=5.0)
    assert not settle_longer(extended=False, unreachable=False, attempts=1, retries=2, time_left=5.0)
    assert not settle_longer(extended=False, unreachable=True, attempts=3, retries=2, time_left=5.0)
    assert not settle_longer(extended=False, unreachable=True, attempts=1, retries=2, time_left=0.0)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_reads_as_a_line(outcome):
    text = describe(outcome, detail="the reason", count=2)
    assert (text is None) == (outcome is Outcome.APPLIED)
    assert text is None or ("\n" not in text and "{" not in text)


def test_every_phase_decides():
    assert {phase for phase in Phase} == {Phase.BEGIN, Phase.READY, Phase.FAILED, Phase.SETTLED, Phase.CAUGHT_UP,
                                          Phase.AVERAGED, Phase.CROSSED, Phase.RECEIVED}
    for phase in Phase:
        facts = dict(gathered={"me": Contribution(epoch=5, hash="aa", tokens=1)}, failure=Failure.LOST_MEMBER)
        assert isinstance(decide(view(phase, **facts)), Action)


# ---- rounds of many groups (peer/swarm/grouping.py) ----

def test_more_peers_at_our_state_than_a_group_holds_meet_in_groups():
    holders = [peer(f"h{i}") for i in range(5)]
    ours, size, mates, groups = plan([r.peer_id for r in holders], "me", MINE.epoch, 2)
    action = decide(dataclasses.replace(view(Phase.READY, *holders), group_size=2))
    assert (action.do, action.expected, action.target, action.groups, action.group) == (Do.AVERAGE, 6, size, groups,
                                                                                        ours)
    assert groups == 3 and set(action.probe) == set(mates)  # we dial only the peers expected in our group
    one = decide(dataclasses.replace(view(Phase.READY, *holders), group_size=5))  # 6 peers: one group
    assert (one.expected, one.target, one.groups, one.group) == (6, 6, 1, -1)
    assert decide(view(Phase.READY, *holders)).target == 6  # group_size 0: always one group


def test_a_peer_whose_group_holds_nobody_else_goes_across_at_once():
    same = [f"h{i}" for i in range(80) if grouping.group_of(f"h{i}", MINE.epoch, 3) == 0][:5]  # 5 in one of 3 groups
    holders = [peer(name) for name in same]
    names = [r.peer_id for r in holders]
    alone = next(name for name in (f"x{i}" for i in range(200)) if plan(names, name, MINE.epoch, 2)[1] == 1)
    lonely = dataclasses.replace(view(Phase.READY, *holders), mine=dataclasses.replace(MINE, peer_id=alone),
                                 group_size=2)
    assert decide(lonely) == Action(Do.CROSS, expected=plan(names, alone, MINE.epoch, 2)[3], voters=6)
    # its group of one carries the electorate of six: if no other group's delegate comes, it is a minority and
    # does not step alone (counting itself only, it did: a fork)
    group = members(alone, voters=decide(lonely).voters)
    assert decide(view(Phase.CROSSED, failure=Failure.NO_GROUP, group=group, crosses=1, groups=3)) == Action(
        Do.FINISH, Outcome.NO_OTHER_GROUPS)


def members(*names, voters=6, epoch=5):
    return {name: Contribution(epoch=epoch, hash="aa", tokens=10, weight=10.0, voters=voters, groups=3)
            for name in names}


def test_a_minority_group_goes_across_through_its_delegate():
    gathered = members("me", "a")
    speaker = delegate(gathered, MINE.epoch)
    action = decide(view(Phase.AVERAGED, gathered=gathered, groups=3))
    if speaker == "me":
        assert action == Action(Do.CROSS, expected=3)
    else:
        assert action == Action(Do.RECEIVE, delegate="a")
    # in a round of many groups even a majority group goes across, so that every group's work merges
    assert decide(view(Phase.AVERAGED, gathered=members("me", "a", "b", "c"), groups=2)).do in (Do.CROSS,
                                                                                               Do.RECEIVE)
    one = {name: dataclasses.replace(c, groups=1) for name, c in members("me", "a").items()}
    assert decide(view(Phase.AVERAGED, gathered=one)) == Action(Do.APPLY)  # one group of all: gated, applied


def test_after_the_cross_group_phase():
    merged = members("me", "a", "b", "c", "d", "e")
    assert decide(view(Phase.CROSSED, gathered=merged, crosses=1)) == Action(Do.APPLY)
    crossed = dict(crosses=1, groups=3)
    assert decide(view(Phase.CROSSED, failure=Failure.NO_GROUP, **crossed)) == Action(Do.FINISH,
                                                                                     Outcome.NO_OTHER_GROUPS)
    # no other group came, but ours is a majority of the peers at our state: it applies on its own
    assert decide(view(Phase.CROSSED, failure=Failure.NO_GROUP, group=members("me", "a", "b", "c"),
                       **crossed)) == Action(Do.APPLY, own_group=True)
    # ours came late: the swarm's round ended without it (a live peer holds the next state), so it catches up,
    # a majority or not, and stops there whether or not the catch-up adopts a state
    ahead = peer("x", epoch=6, state="cc", tokens=900)
    for group in (None, members("me", "a", "b", "c")):
        assert decide(view(Phase.CROSSED, ahead, failure=Failure.NO_GROUP, group=group, **crossed)) == Action(
            Do.CATCH_UP)
    assert decide(view(Phase.CAUGHT_UP, ahead, caught_up=True, failure=Failure.NO_GROUP, **crossed)) == Action(
        Do.FINISH, Outcome.MISSED_GROUP)
    assert decide(view(Phase.CAUGHT_UP, ahead, caught_up=False, failure=Failure.NO_GROUP, **crossed)) == Action(
        Do.FINISH, Outcome.NO_OTHER_GROUPS)
    assert decide(view(Phase.CROSSED, failure=Failure.LOST_MEMBER, **crossed)) == Action(Do.CROSS,
                                                                                        Outcome.LOST_MEMBER,
                                                                                        expected=3)
    assert decide(view(Phase.CROSSED, failure=Failure.LOST_MEMBER, crosses=3, groups=3)) == Action(
        Do.FINISH, Outcome.LOST_MEMBER)
    assert decide(view(Phase.CROSSED, failure=Failure.MINORITY, **crossed)) == Action(Do.SETTLE)
    assert decide(view(Phase.CROSSED, failure=Failure.NO_MAJORITY, **crossed)) == Action(Do.FINISH, Outcome.MINORITY)
    assert decide(view(Phase.CROSSED, failure=Failure.MAYBE_APPLIED, **crossed)) == Action(Do.SETTLE,
                                                                                          Outcome.LOST_MEMBER)
    # a delegate whose settle found nothing does not start its group's round over
    assert decide(view(Phase.SETTLED, failure=Failure.MAYBE_APPLIED, crosses=1)) == Action(Do.FINISH,
                                                                                          Outcome.LOST_MEMBER)


def test_after_asking_our_delegate():
    merged = members("me", "a", "b", "c", "d", "e")
    assert decide(view(Phase.RECEIVED, gathered=merged)) == Action(Do.APPLY)
    other = dict(merged, a=dataclasses.replace(merged["a"], hash="bb"))
    assert decide(view(Phase.RECEIVED, gathered=other)) == Action(Do.FINISH, Outcome.STATE_MISMATCH)
    assert decide(view(Phase.RECEIVED, failure=Failure.DELEGATE_LOST)) == Action(Do.SETTLE)
    assert decide(view(Phase.RECEIVED, failure=Failure.MINORITY)) == Action(Do.SETTLE)
    assert decide(view(Phase.RECEIVED, failure=Failure.NO_MAJORITY)) == Action(Do.FINISH, Outcome.MINORITY)
    lost = dict(failure=Failure.DELEGATE_LOST)
    assert decide(view(Phase.SETTLED, settled=True, merged_ours=True, **lost)) == Action(
        Do.FINISH, Outcome.GROUP_FINISHED_WITHOUT_US)
    assert decide(view(Phase.SETTLED, settled=False, **lost)) == Action(Do.FINISH, Outcome.DELEGATE_LOST)


def test_groups_their_delegates_and_what_they_merge():
    # never two groups: neither would be a majority alone, so one lost delegate would cost every peer the round
    assert [group_count(n, 4) for n in (1, 4, 5, 6, 9, 10, 13, 14, 17, 18)] == [1, 1, 1, 1, 1, 3, 3, 4, 4, 5]
    assert {group_count(n, 4) for n in range(14, 18)} == {4}  # a peer more or less around 16: the same 4 groups
    assert group_count(100, 0) == 1
    roster = [f"p{i}" for i in range(41)]
    plans = {me: plan(roster, me, 9, 8) for me in roster}  # every peer plans the others' groups as they do
    sizes = collections.Counter(group for group, *_ in plans.values())
    assert all(size == sizes[group] for group, size, _, _ in plans.values())  # each knows its group's size
    assert all(plans[mate][0] == plans[me][0] for me in roster for mate in plans[me][2])
    assert {groups for *_, groups in plans.values()} == {5}
    # a peer the others disagree about (dead, say) changes only its own group's plan (while the count stands)
    without = {me: plan(roster[1:], me, 9, 8) for me in roster[1:]}
    changed = {me for me in roster[1:] if without[me][1] != plans[me][1]}
    assert changed == set(plans["p0"][2])
    assert len({plan(roster, "p1", epoch, 8)[2][0] for epoch in range(6)}) > 1  # groups mix from epoch to epoch
    # around a boundary of the rounding (60 peers in groups of 8: 7.5), views a peer apart count the groups alike
    # once they count the state's producers, which every peer at the state holds alike
    boundary = [f"p{i}" for i in range(60)]
    assert plan(boundary, "p1", 9, 8)[3] != plan(boundary[2:], "p1", 9, 8)[3]
    agreed = [plan(boundary[k:], "p1", 9, 8, producers=60)[3] for k in (0, 2)]
    assert agreed[0] == agreed[1] == 8
    group = members("a", "b", "c")
    assert delegate(group, 5) == delegate(dict(reversed(list(group.items()))), 5)  # every member elects alike
    assert len({delegate(group, epoch) for epoch in range(20)}) > 1  # the duty moves from round to round
    clients = {k: dataclasses.replace(c, client=k != "c") for k, c in group.items()}
    assert delegate(clients, 5) == "c"  # a client cannot serve the result
    first = Delegation(epoch=5, hash="aa", align=False, members=members("a", "b"))
    second = Delegation(epoch=5, hash="aa", align=False, members=members("c"))
    assert set(union([first, second])) == {"a", "b", "c"} and first.weight() == 20.0
    assert union([first, first]) == first.members  # a peer in two groups' averages counts once
    assert Delegation.from_wire(first.to_wire()) == first
    with pytest.raises(ValueError, match="must hold its epoch"):
        Delegation.from_wire(dict(first.to_wire(), epoch=6))


def test_of_three_groups_any_two_cross_as_a_majority_and_of_two_neither_could_alone():
    """Why a round never has two groups (``group_count``): the cross-group phase applies only as a majority, so with
    two groups one lost delegate costs every peer the round; with three, the two others still apply."""
    def delegation(group, voters):
        return Delegation(epoch=5, hash="aa", align=False, members=members(*group, voters=voters))

    thirds = [[f"g{g}m{m}" for m in range(5)] for g in range(3)]  # 15 peers in 3 groups
    for lost in range(3):
        words = {group[0]: delegation(group, 15) for g, group in enumerate(thirds) if g != lost}
        assert len(grouping.admit(words, cross=True)) == 10
    halves = [[f"g{g}m{m}" for m in range(8)] for g in range(2)]  # 16 peers in 2 groups
    with pytest.raises(NoMajority):
        grouping.admit({halves[0][0]: delegation(halves[0], 16)}, cross=True)
    assert group_count(16, 8) == 1 and group_count(15, 5) == 3


def test_a_peer_left_over_when_the_groups_filled_does_not_go_across():
    # the cross-group round closes when the planned groups' delegates came: a left-over one would take a group's place
    left = dict(failure=Failure.NO_GROUP, expected=5, attempts=1)
    assert decide(view(Phase.FAILED, groups=3, **left)) == Action(Do.CATCH_UP)
    assert decide(view(Phase.FAILED, groups=1, **left)) == Action(Do.CATCH_UP)  # one group of all: it missed it
