"""The striped download in-process: pieces spread over donors, a failed donor's share goes to the others, and a
donor whose connection a relay reset (after a piece came through) gets one more try."""

import asyncio

from peer.averaging.striping import stripe


def run(donors, count, fail):
    """``fail(donor, piece, attempt) -> bool``: whether that fetch raises."""
    attempts = {}

    async def fetch(donor, piece):
        attempts[donor] = attempts.get(donor, 0) + 1
        await asyncio.sleep(0)
        if fail(donor, piece, attempts[donor]):
            raise ConnectionResetError("relayed connection reset")
        return f"{donor}:{piece}"

    return asyncio.run(stripe(donors, count, fetch, "test download")), attempts


def test_every_piece_comes_once_from_some_donor():
    got, _ = run(["a", "b", "c"], 9, lambda *_: False)
    assert sorted(got) == list(range(9)) and all(value == f"{donor}:{piece}" for piece, (donor, value) in got.items())
    assert {donor for donor, _ in got.values()} == {"a", "b", "c"}


def test_a_donor_that_fails_at_once_is_dropped_and_the_others_take_its_share():
    got, attempts = run(["a", "b"], 6, lambda donor, piece, attempt: donor == "a")
    assert sorted(got) == list(range(6)) and {donor for donor, _ in got.values()} == {"b"}
    assert attempts["a"] == 1


def test_a_lone_relayed_donor_reset_after_every_second_piece_still_serves_them_all():
    # a stock p2pd relay carries 128 KiB a connection: two 64 KiB slices, then a reset; the next stream gets a
    # fresh connection
    got, attempts = run(["relayed"], 8, lambda donor, piece, attempt: attempt % 3 == 0)
    assert sorted(got) == list(range(8)) and attempts["relayed"] == 8 + 3


def test_two_failures_in_a_row_drop_the_donor():
    got, attempts = run(["relayed"], 4, lambda donor, piece, attempt: attempt >= 2)
    assert sorted(got) == [0] and attempts["relayed"] == 3  # one piece, a failure, one more try, a failure
