"""The striped download in-process: pieces spread over donors, a failed donor's share goes to the others, and a
donor whose connection a relay reset (after a piece came through) gets one more try, and so does, once, a donor whose
stream was cut before it answered."""

import asyncio
import gc
import logging

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from peer.averaging.results import PENDING, READY, check_slice
from peer.averaging.sharing import StateSharing
from peer.averaging.striping import StreamCut, stripe


def run(donors, count, fail, error=ConnectionResetError("relayed connection reset")):
    """``fail(donor, piece, attempt) -> bool``: whether that fetch raises ``error``."""
    attempts = {}

    async def fetch(donor, piece):
        attempts[donor] = attempts.get(donor, 0) + 1
        await asyncio.sleep(0)
        if fail(donor, piece, attempts[donor]):
            raise error
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


def test_a_donor_whose_first_stream_is_cut_gets_one_more_try():
    # after a partition heals, the first stream to each donor of the other side was reset (4 peers, a split healed)
    for error in (StreamCut("the stream ended before the donor answered"),
                  ControlFailure("Connect failed. msg=failed to negotiate protocol: stream reset")):
        got, attempts = run(["a", "b"], 6, lambda donor, piece, attempt: attempt == 1, error)
        assert sorted(got) == list(range(6)) and {donor for donor, _ in got.values()} == {"a", "b"}
        assert attempts == {"a": 4, "b": 4}  # 3 pieces each, after one cut each


def test_a_donor_cut_twice_before_it_answered_is_dropped():
    got, attempts = run(["a", "b"], 6, lambda donor, piece, attempt: donor == "a", StreamCut("cut"))
    assert sorted(got) == list(range(6)) and {donor for donor, _ in got.values()} == {"b"}
    assert attempts["a"] == 2


def test_a_refusal_is_not_a_cut():
    got, attempts = run(["a", "b"], 6, lambda donor, piece, attempt: donor == "a",
                        ValueError("the donor no longer holds that state"))
    assert {donor for donor, _ in got.values()} == {"b"} and attempts["a"] == 1


def test_a_silent_donors_piece_is_asked_of_another_and_the_silent_fetch_is_cancelled(caplog):
    """The end game: a donor that never answers (frozen; or its connection still in TCP's backoff after a heal)
    holds one piece; once every other piece is in, an idle donor asks for that one too, and the download ends
    without waiting out the part timeout."""
    cancelled = []

    async def fetch(donor, piece):
        if donor == "silent":
            try:
                await asyncio.get_running_loop().create_future()  # never answers
            except asyncio.CancelledError:
                cancelled.append(piece)
                raise
        await asyncio.sleep(0)
        return f"{donor}:{piece}"

    async def download():
        return await asyncio.wait_for(stripe(["silent", "a"], 4, fetch, "test download", stalled=0.01), 30)

    with caplog.at_level(logging.DEBUG):
        got = asyncio.run(download())
        gc.collect()  # what the download left behind: asyncio reports a task's end nobody retrieved when collected
    assert sorted(got) == list(range(4)) and {donor for donor, _ in got.values()} == {"a"}
    assert cancelled == [0]  # the silent donor's piece, taken from "a", and its fetch cancelled
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR] == []


def test_a_silent_piece_is_asked_of_one_more_donor_not_of_every_idle_one():
    asked = []

    async def fetch(donor, piece):
        asked.append((donor, piece))
        if donor == "silent" or piece == 0:  # piece 0 stalls at whichever donor it is asked of
            await asyncio.get_running_loop().create_future()
        await asyncio.sleep(0)
        return f"{donor}:{piece}"

    async def download():
        return await asyncio.wait_for(stripe(["silent", "b", "c", "a"], 4, fetch, "test download", stalled=0.01), 0.5)

    with pytest.raises(asyncio.TimeoutError):  # piece 0 never comes
        asyncio.run(download())
    # the silent donor, and one of the three idle ones: not all three
    assert [donor for donor, piece in asked if piece == 0][0] == "silent"
    assert sum(piece == 0 for _, piece in asked) == 2


def test_a_result_slice_cut_after_its_ready_status_is_tried_again_and_a_result_no_longer_served_is_not():
    """A round's result (``peer/averaging/results.py``): a stream that ends after the donor said the result is ready,
    before its parts, was cut, and the donor gets one more try; a donor whose status says it no longer serves the
    result is dropped. A lone survivor, the only donor of a replay, was once dropped for the first."""
    answers = {("lone", 1): ({"status": READY}, 0), ("lone", 2): ({"status": READY}, 2),
               ("gone", 1): ({"status": PENDING}, 0)}
    attempts = {}

    async def fetch(donor, piece):
        attempts[donor] = attempts.get(donor, 0) + 1
        info, parts = answers[(donor, attempts[donor])]
        check_slice(donor, info, parts, 2)
        return parts

    for donors in (["lone"], ["gone"]):
        got = asyncio.run(stripe(donors, 1, fetch, "result download"))
        assert (got == {0: ("lone", 2)}) if donors == ["lone"] else (got == {} and attempts["gone"] == 1)


def test_a_state_slice_cut_after_the_donors_answer_is_a_cut_and_a_refusal_is_not():
    """The state download's twin (``peer/averaging/sharing.py``): a stream that ends after the donor's first part
    said it holds the state was cut (tried again on a fresh stream); a donor that says it lacks the state refused."""
    values = torch.arange(40_000, dtype=torch.float32)  # 160 kB: three parts of 64 kB
    parts = list(split_for_streaming(serialize_torch_tensor(values)))
    header = MSGPackSerializer.dumps(dict(hash="h", epoch=3))

    class Stub:
        def __init__(self, messages):
            self.messages = messages

        async def rpc_download_slice(self, request):
            async def stream():
                for message in self.messages:
                    yield message
            return stream()

    whole = [averaging_pb2.DownloadData(tensor_part=part, metadata=header if i == 0 else b"")
             for i, part in enumerate(parts)]
    refusal = [averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(hash=None)))]
    sharing = StateSharing()
    sharing.serializer = MSGPackSerializer

    def fetch(messages):
        return asyncio.run(sharing._fetch_slice(Stub(messages), "h", 0, values.numel(), part_timeout=5.0))

    assert torch.equal(fetch(whole)[1], values)
    with pytest.raises(StreamCut):
        fetch(whole[:1])
    with pytest.raises(ValueError, match="no longer holds"):
        fetch(refusal)
