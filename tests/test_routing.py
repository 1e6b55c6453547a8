"""The averager's routing of groupmates' streams to its all-reduce (``SwarmAverager.rpc_aggregate_part``),
in-process: the real handler, hivemind's group registry, a runner that echoes."""

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.proto import averaging_pb2

from dht import internals
from peer.averaging.averager import SwarmAverager

GROUP = b"group"


class Echo:
    """A registered all-reduce runner that answers each part with itself."""

    async def rpc_aggregate_part(self, stream, _context):
        async for request in stream:
            yield request


def test_a_stream_reset_before_our_runner_is_registered_leaves_the_group_to_the_others():
    """Two groupmates' streams wait for our runner; the first one's connection resets (hivemind cancels its
    handler). Its wait once cancelled the group's future: the other groupmate's stream died with it, and our own
    registration raised InvalidStateError, failing the round that a resumed stream would have finished."""
    averager = SwarmAverager.__new__(SwarmAverager)  # only what routing reads; no process, no DHT
    averager._parent_pid = None  # not started here: nothing to shut down when it is collected

    async def scenario():
        averager._lingering, averager._running_groups = {}, {GROUP: asyncio.get_running_loop().create_future()}
        averager._pending_groups_registered = asyncio.Event()
        averager._pending_groups_registered.set()

        async def parts(value):
            yield averaging_pb2.AveragingData(group_id=GROUP, weight=value)

        def stream(value):
            return asyncio.ensure_future(averager.rpc_aggregate_part(parts(value), SimpleNamespace()).__anext__())

        reset, other = stream(1.0), stream(2.0)
        for _ in range(3):
            await asyncio.sleep(0)  # both wait for the runner now
        assert not reset.done() and not other.done()
        reset.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reset
        internals.register_runner(averager, GROUP, Echo())
        return await asyncio.wait_for(other, 5)

    assert asyncio.run(scenario()).weight == 2.0
