"""Every outcome of the round's decision, as a pure function of a typed view: no network, no tensors, no time."""

import dataclasses

import pytest

from dht.records import PeerRecord
from peer.round.decide import Action, Do, Failure, Outcome, Phase, View, decide, describe, settle_longer
from peer.swarm.consensus import MAX_MISSED, SYNCING
from peer.swarm.metadata import Contribution

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
    assert action.voters == 3  # us and the two at our state; neither the joiner nor the peer behind votes


def test_producers_vote_whatever_epoch_their_record_shows():
    producer = peer("p", epoch=4, state="zz", tokens=100)
    assert decide(view(Phase.READY, peer("a"), producer, producers=("p",))).voters == 3


def test_ready_alone():
    assert decide(view(Phase.READY)) == Action(Do.STEP_ALONE)
    assert decide(view(Phase.READY, finite=False)) == Action(Do.FINISH, Outcome.DIVERGED)
    # a late read of the records may be empty only because it is late: wait, until stalled
    assert decide(view(Phase.READY, lookup_failed=True)) == Action(Do.FINISH, Outcome.RECORDS_LATE)
    assert decide(view(Phase.READY, lookup_failed=True, stuck=MAX_MISSED - 1)) == Action(Do.STEP_ALONE)
    # the others are behind: they join us next round
    behind = peer("b", epoch=3, state="bb", tokens=300)
    assert decide(view(Phase.READY, behind)) == Action(Do.FINISH, Outcome.PEERS_BEHIND, count=1)
    assert decide(view(Phase.READY, behind, stuck=MAX_MISSED - 1)) == Action(Do.STEP_ALONE)
    # a live peer holds a better state (its download failed): never step alone, even stalled
    ahead = peer("x", epoch=6, state="cc", tokens=900)
    assert decide(view(Phase.READY, ahead, stuck=MAX_MISSED)) == Action(Do.FINISH, Outcome.PEERS_AHEAD, count=1)
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
    assert decide(view(Phase.CAUGHT_UP, caught_up=False, holders_syncing=False, stuck=MAX_MISSED - 1,
                       **missed)) == Action(Do.STEP_ALONE)
    assert decide(view(Phase.CAUGHT_UP, holder, caught_up=False, holders_syncing=False, stuck=MAX_MISSED - 1,
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
                                          Phase.AVERAGED}
    for phase in Phase:
        facts = dict(gathered={"me": Contribution(epoch=5, hash="aa", tokens=1)}, failure=Failure.LOST_MEMBER)
        assert isinstance(decide(view(phase, **facts)), Action)
