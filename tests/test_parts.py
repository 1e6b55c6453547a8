"""How an all-reduce cuts its vector into parts (``parts.part_bytes``): balanced shares, whole codec blocks; and how
a stream of parts is decoded in threads, each against its own shape (``parts.decode_in_order``)."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from diloco_compression import CODECS, get_codec

from peer.averaging.parts import PART_BYTES, CodecCompression, ExactPartContainer, decode_in_order, part_bytes

FRAGMENT = 2_800_000  # about one fragment of the small preset (10.7M values) at --fragments 4


def shares(values: int, reducers: int, codec: str, size: int) -> list:
    """Values each of ``reducers`` equal members reduces, as hivemind's container deals the parts."""
    container = ExactPartContainer([torch.zeros(values)], (1.0,) * reducers,
                                   compression=CodecCompression(get_codec(codec)), part_size_bytes=size)
    return [sum(part.numel() for part in container.get_raw_input_parts(i)) for i in range(reducers)]


@pytest.mark.parametrize("reducers", [2, 3, 4, 8])
def test_each_member_reduces_within_a_part_of_an_equal_share(reducers):
    balanced = FRAGMENT / reducers
    dealt = shares(FRAGMENT, reducers, "int4-huffman", part_bytes(FRAGMENT, reducers, get_codec("int4-huffman")))
    assert sum(dealt) == FRAGMENT
    assert max(dealt) <= 1.2 * balanced, dealt
    # the fixed 1 MiB parts this replaced: 2 parts for 4 reducers, one of them reducing three quarters
    if reducers == 4:
        assert max(shares(FRAGMENT, 4, "int4-huffman", PART_BYTES[1])) >= 2.9 * balanced


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("values", [1_000, FRAGMENT, 11_000_000, 1_100_000_000])
def test_parts_are_whole_codec_blocks_and_bounded(codec, values):
    size = part_bytes(values, 4, get_codec(codec))
    assert PART_BYTES[0] <= size <= PART_BYTES[1]
    part_values = int(size / (4 * CodecCompression(get_codec(codec)).estimate_compression_ratio(None)))
    assert part_values % getattr(get_codec(codec), "block", 1) == 0


class LaterFirst(ThreadPoolExecutor):
    """Runs each even-numbered job only once the job submitted after it has run: threads that start in the reverse
    of the order they were given, as Python 3.13's did for an all-reduce's part decodes."""

    def __init__(self):
        super().__init__(max_workers=2)
        self.submitted = 0
        self.gates = {}

    def submit(self, fn, /, *args, **kwargs):
        number, self.submitted = self.submitted, self.submitted + 1
        gate = self.gates.setdefault(number | 1, threading.Event())
        if number % 2 == 0:
            def job():
                assert gate.wait(10), "the later job never ran"
                return fn(*args, **kwargs)
        else:
            def job():
                try:
                    return fn(*args, **kwargs)
                finally:
                    gate.set()
        return super().submit(job)


def test_parts_decoded_in_threads_that_run_out_of_order_keep_their_own_shapes():
    """A member once took each averaged part's expected shape inside its decode, in a thread: the thread of the last
    (short) part ran first and took the first part's shape, and a correct reducer was called malformed
    ("sent a malformed averaged part: shape (16384,), expected (3395,)"), failing 4 of test_allreduce's 14 tests on
    Python 3.13. Each part's shape is now given by its place in the stream."""
    shapes = [torch.Size([16384]), torch.Size([8192]), torch.Size([3395])]

    async def stream():
        for shape in shapes + [torch.Size([7])]:  # one part more than the reducer has: no shape for it
            yield shape

    async def decoded():
        executor = LaterFirst()
        asyncio.get_running_loop().set_default_executor(executor)
        try:
            return [pair async for pair in decode_in_order(lambda sent, expected: (sent, expected), stream(), shapes)]
        finally:
            executor.shutdown(wait=False)

    assert asyncio.run(decoded()) == [(shape, shape) for shape in shapes] + [(torch.Size([7]), None)]
