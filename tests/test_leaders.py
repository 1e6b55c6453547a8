"""Whom a round's matchmaking asks to lead: the expected peers from our records, ranked by id (fake clock)."""

import asyncio
from types import SimpleNamespace

from dht import internals
from peer.averaging.leaders import HOLD, RETRY_EVERY, RecordLeaders, leader_queue

PEERS = ["QmA", "QmB", "QmC", "QmD"]


def test_each_peer_asks_only_the_peers_below_it_lowest_first_before_its_own_window_ends():
    queues = {own: leader_queue(own, PEERS, declared=100.0, now=90.0) for own in PEERS}
    assert [peer for peer, _ in queues["QmA"]] == []  # the lowest asks nobody: it leads
    assert [peer for peer, _ in queues["QmD"]] == ["QmA", "QmB", "QmC"]
    for own, entries in queues.items():
        # hivemind asks the entry of lowest expiration first, and only those ranking above its own declaration
        assert entries == sorted(entries, key=lambda e: e[1]), own
        assert all(90.0 < expiration <= 90.0 + HOLD and expiration < 100.0 for _, expiration in entries), own
    # every peer that read the same records ranks the same lowest peer first
    assert {entries[0][0] for own, entries in queues.items() if entries} == {"QmA"}


def test_a_pass_ends_before_our_window_and_none_is_served_past_it():
    entries = leader_queue("QmD", PEERS, declared=91.0, now=90.0)
    assert all(expiration < 91.0 for _, expiration in entries)
    assert leader_queue("QmD", PEERS, declared=90.01, now=90.0) == []


def test_passes_repeat_from_the_lowest_every_retry_interval_and_a_round_without_peers_reads_the_dht(monkeypatch):
    now = [50.0]
    leaders = RecordLeaders("QmC", clock=lambda: now[0])
    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    async def passes():
        leaders.set_round(["QmC", "QmB", "QmA"])
        first = await leaders.queue(declared=60.0)
        second = await leaders.queue(declared=60.0)
        leaders.set_round([])
        return first, second, await leaders.queue(declared=60.0)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    first, second, none = asyncio.run(passes())
    assert [p for p, _ in first] == [p for p, _ in second] == ["QmA", "QmB"]
    assert slept == [RETRY_EVERY]  # the round's first pass at once, the next one an interval later
    assert second[0][1] > first[0][1]  # fresh entries: hivemind skips an entry it already asked, by (peer, expiry)
    assert none is None  # no expected peers: hivemind's own lookup of the DHT's declarations
    assert leaders.is_expected("QmA") is False  # cleared with the round


def test_a_client_which_cannot_lead_asks_every_expected_peer_lowest_first():
    """A peer behind a NAT whose id sorts lowest asked nobody, and nobody asked it: it never met (seen in CI)."""
    assert [peer for peer, _ in leader_queue("Qm0", PEERS, declared=100.0, now=90.0, client=True)] == PEERS


def test_a_follower_the_records_missed_joins_as_one_more_and_takes_no_expected_members_place():
    """A joiner whose record had not reached the leader came to it first and filled the group at its expected count;
    an expected member, a moment later, missed the round (``tests/test_swarm.py``'s joiner, in CI). hivemind's
    leader checks each join request (``_check_reasons_to_reject``, wrapped by ``seed_leaders``), then closes at the
    target's count: an unexpected follower it accepts raises the target by one, once a round."""
    leaders = RecordLeaders("B", clock=lambda: 0.0)
    verdicts = {}
    matchmaking = SimpleNamespace(
        group_key_manager=SimpleNamespace(get_averagers=None), potential_leaders=SimpleNamespace(
            declared_expiration_time=float("inf")),
        _check_reasons_to_reject=lambda request, context: verdicts.get(context.remote_id.to_base58()))
    internals.seed_leaders(matchmaking, leaders.queue, leaders.is_expected, leaders.is_unexpected)

    def ask(peer):
        context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))
        return matchmaking._check_reasons_to_reject(SimpleNamespace(expiration=1.0), context)

    leaders.set_round(["C"], members=["C", "N"])  # C accepts connections and is probed; N is behind a NAT
    internals.set_group_sizes(matchmaking, 2, 3)
    assert ask("J") is None and matchmaking.target_group_size == 4  # the joiner our records missed: one more
    assert ask("J") is None and matchmaking.target_group_size == 4  # asking again (it left, say): still one
    assert ask("C") is None and ask("N") is None and matchmaking.target_group_size == 4  # the expected: no change
    verdicts["K"] = "GROUP_IS_FULL"
    assert ask("K") == "GROUP_IS_FULL" and matchmaking.target_group_size == 4  # refused: not one more
    internals.set_group_sizes(matchmaking, 2, 3)  # the next round counts afresh
    assert ask("J") is None and matchmaking.target_group_size == 4
    leaders.set_round([], members=[])  # a round without records (a cross, hivemind's declarations): nobody is extra
    internals.set_group_sizes(matchmaking, 2, 3)
    assert ask("X") is None and matchmaking.target_group_size == 3
