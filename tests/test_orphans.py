"""asyncio's records of hivemind's tasks (and the DHT's requests) collected pending stay off a user's terminal; every
other one shows."""

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import tempfile
import types

import pytest
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.utils.asyncio import asingle
from hivemind.utils.multiaddr import Multiaddr

from dht.node import SwarmDHT
from peer.ops.orphans import (
    CONNECTED_CALLBACK,
    DESTROYED_PENDING,
    NEVER_RETRIEVED,
    REUSED_COROUTINE,
    OrphanedTaskNoise,
    quiet_orphaned_tasks,
)


@pytest.fixture
def quiet():
    asyncio_logger = logging.getLogger("asyncio")
    quiet_orphaned_tasks()
    quiet_orphaned_tasks()
    yield [f for f in asyncio_logger.filters if isinstance(f, OrphanedTaskNoise)]
    for f in list(asyncio_logger.filters):
        if isinstance(f, OrphanedTaskNoise):
            asyncio_logger.removeFilter(f)


async def stalled():
    """An async iterator that waits on a future nobody else holds: its waiter is garbage once abandoned."""
    await asyncio.get_running_loop().create_future()
    yield None


async def our_own_wait():
    async for _ in stalled():
        pass


def orphan_and_collect(make_coroutine) -> None:
    """Start a task, let it reach its wait, drop every reference to it and collect it, as hivemind's abandoned
    stream tasks are after a failed all-reduce."""
    loop = asyncio.new_event_loop()
    try:
        async def start():
            loop.create_task(make_coroutine())
            await asyncio.sleep(0)  # one turn of the loop: the task runs to its wait

        loop.run_until_complete(start())
    finally:
        loop.close()
    gc.collect()


def asyncio_errors(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]


async def request(dht, node):
    async for _ in stalled():
        pass


def test_a_hivemind_task_collected_pending_is_kept_quiet_and_our_own_is_not(quiet, caplog):
    assert len(quiet) == 1, "installing twice installs one filter"
    dht = types.SimpleNamespace(_node=None, _answering=set())
    dht._answer = functools.partial(SwarmDHT._answer, dht)
    with caplog.at_level(logging.DEBUG):
        orphan_and_collect(lambda: asingle(stalled()))
        orphan_and_collect(lambda: SwarmDHT._run_coroutine(dht, request, concurrent.futures.Future()))
        assert asyncio_errors(caplog) == []

        orphan_and_collect(our_own_wait)
    errors = asyncio_errors(caplog)
    assert len(errors) == 1 and errors[0].startswith(DESTROYED_PENDING) and "our_own_wait" in errors[0]


def test_the_p2p_handlers_reused_coroutine_is_kept_quiet_and_any_other_callback_error_is_not(quiet, caplog):
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler(dict(message=CONNECTED_CALLBACK, exception=RuntimeError(REUSED_COROUTINE)))
            assert asyncio_errors(caplog) == []

            loop.call_exception_handler(dict(message=CONNECTED_CALLBACK, exception=ValueError("bad frame")))
    finally:
        loop.close()
    errors = asyncio_errors(caplog)
    assert len(errors) == 1 and errors[0].startswith(CONNECTED_CALLBACK)


def test_without_the_filter_asyncio_reports_the_hivemind_task(caplog):
    """The condition the filter names is real: asyncio does log hivemind's task, destroyed pending."""
    with caplog.at_level(logging.DEBUG):
        orphan_and_collect(lambda: asingle(stalled()))
    errors = asyncio_errors(caplog)
    assert len(errors) == 1 and errors[0].startswith(DESTROYED_PENDING) and "/hivemind/" in errors[0]


def hang_up_on_the_p2p_handler(send: bytes = b"") -> None:
    """Connect to hivemind's real p2p client handler on a unix socket, as the daemon does for an incoming stream,
    send ``send`` and hang up: what the daemon does when the stream was reset on its way to us (a healed partition).
    The socket lives in a short temporary directory: a unix socket's path holds at most 104-108 bytes, and pytest's
    own directories exceed that on macOS."""
    async def run(socket_path: str) -> None:
        loop, failed = asyncio.get_running_loop(), asyncio.Event()

        def report(loop, context) -> None:  # asyncio's own report (the logger's filters apply), and a signal
            loop.default_exception_handler(context)
            failed.set()

        loop.set_exception_handler(report)
        client = ControlClient(daemon_connector=None, listen_maddr=Multiaddr(f"/unix{socket_path}"),
                               _initialized_with_create=True)
        async with client.listen():
            _, writer = await asyncio.open_unix_connection(socket_path)
            writer.write(send)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            deadline = loop.time() + 10
            while not failed.is_set():  # Python 3.10 reports a handler's error only once it collects the handler's task
                assert loop.time() < deadline, "asyncio reported nothing within 10 s"
                gc.collect()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(failed.wait(), 0.05)

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(run(os.path.join(directory, "p2p.sock")))


def test_the_daemon_hanging_up_on_the_p2p_handler_is_kept_quiet_and_a_cut_header_is_not(quiet, caplog):
    with caplog.at_level(logging.DEBUG):
        hang_up_on_the_p2p_handler()
        assert asyncio_errors(caplog) == []

        hang_up_on_the_p2p_handler(send=b"\x05ab")  # half a header: not a bare hang-up
    errors = asyncio_errors(caplog)
    assert len(errors) == 1 and errors[0].startswith((CONNECTED_CALLBACK, NEVER_RETRIEVED))  # (the latter: 3.10)


def test_without_the_filter_asyncio_reports_the_daemon_hanging_up(caplog):
    """The condition the filter names is real: the handler fails, and asyncio logs it with its traceback."""
    with caplog.at_level(logging.DEBUG):
        hang_up_on_the_p2p_handler()
    records = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert len(records) == 1 and records[0].getMessage().startswith((CONNECTED_CALLBACK, NEVER_RETRIEVED))
    assert isinstance(records[0].exc_info[1], asyncio.IncompleteReadError)
