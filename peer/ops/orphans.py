"""hivemind's orphaned p2p tasks: what asyncio says when it collects them, kept off a user's terminal.

When an all-reduce fails (a member lost, a connection reset), hivemind abandons the tasks that served its streams:
the p2p client's connection handlers (``ControlClient._handler``) and the feeders of its async generators
(``amap_in_executor``). Nothing references them any more, so the garbage collector destroys them while they still
wait, and asyncio logs each one at ERROR:

    ERROR asyncio: Task was destroyed but it is pending!
    task: <Task pending name='Task-2433' coro=<ControlClient._handler() running at .../hivemind/p2p/...>
    ERROR asyncio: Unhandled exception in client_connected_cb
    RuntimeError: cannot reuse already awaited coroutine

They come after the failure, which our own line already names ("all-reduce failed (lost reducer ...)"), and they
change nothing: the round is retried either way.

A third comes when a partition heals (measured: every peer of a 4-peer split, at the heal): the p2p daemon connects to
the client's handler for a stream that was reset on the way, and hangs up before it says which stream, so the handler
reads nothing:

    ERROR asyncio: Unhandled exception in client_connected_cb
    asyncio.exceptions.IncompleteReadError: 0 bytes read on a total of 1 expected bytes

(Python 3.10's asyncio says the handler's errors only when it collects the handler's task: "Task exception was never
retrieved", the task named in the message.)

No stream reached us, so nothing is lost; the peer that opened it sees its stream reset and retries.

A DHT request that waits on a future nobody else holds is collected the same way, in the DHT's process, and asyncio
names the task that ran it (``SwarmDHT._run_coroutine``, ``dht/node.py``). Its caller hears a timeout, which it
handles as a lookup that came late.

So a peer drops exactly these four records unless it runs ``--verbose``; every other asyncio error still shows.
"""

import asyncio
import logging
import traceback

DESTROYED_PENDING = "Task was destroyed but it is pending!"
DROPPED_REQUEST = "SwarmDHT._run_coroutine()"  # a DHT request's task, in asyncio's record of it
CONNECTED_CALLBACK = "Unhandled exception in client_connected_cb"
NEVER_RETRIEVED = "Task exception was never retrieved"  # Python 3.10: a handler's error, once its task is collected
REUSED_COROUTINE = "cannot reuse already awaited coroutine"


class OrphanedTaskNoise(logging.Filter):
    """Drops asyncio's records of hivemind's own tasks and of the DHT's requests, destroyed pending, of its p2p
    handler's reused coroutine, and of that handler's stream that the daemon hung up on unannounced; lets every other
    record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(DESTROYED_PENDING):
            return "/hivemind/" not in message and DROPPED_REQUEST not in message
        handler = message.startswith(CONNECTED_CALLBACK) or (
            message.startswith(NEVER_RETRIEVED) and "ControlClient._handler()" in message)
        if handler and record.exc_info:
            error = record.exc_info[1]
            if isinstance(error, RuntimeError) and REUSED_COROUTINE in str(error):
                return False
            return not (isinstance(error, asyncio.IncompleteReadError) and not error.partial
                        and in_hivemind_p2p(record.exc_info[2]))
        return True


def in_hivemind_p2p(trace) -> bool:
    """Was the error raised under hivemind's p2p client (its handler's read of the stream's header)?"""
    return any("/hivemind/p2p/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(trace))


def quiet_orphaned_tasks() -> None:
    """Install the filter on asyncio's logger, once; processes forked after this (hivemind's averager) keep it."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, OrphanedTaskNoise) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(OrphanedTaskNoise())
