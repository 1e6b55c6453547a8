"""The swarm's helper processes: hivemind's DHT and averager, forked, and the p2p daemons they start, all of them
gone when the peer is, however it ends.

- ``fork_children``: the start method hivemind is built on, set once at a program's start (and a quiet end to a
  handover that a dying helper broke);
- ``init_child_process``: first thing in every forked helper: die with the parent, and leave SIGTERM to it;
- ``stop_process``: shut a helper down, and SIGKILL it should it outlive that;
- ``spawn_daemon_detached``: the p2p daemon in its own process group (a terminal's Ctrl+C is the peer's to handle),
  dying with the process that started it;
- ``part_died``, ``LinkLost``: the line, and the exception, for a node whose helper died;
- ``answer``, ``holding``: wait for a helper's answer, or for a lock it shares, unless the helper has died.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Any, Iterator, Optional

from dht.errors import UserError

logger = logging.getLogger(__name__)

DEATH_POLL = 0.5  # seconds between looks at whether the helper we wait on is alive


def fork_children() -> None:
    """Start hivemind's processes (the DHT, the averager) by fork, the start method hivemind is built on: a child
    inherits its parent's objects (closures, shared tensors, the running DHT), which forkserver, Python 3.14's
    default on Linux, and spawn would have to pickle, and cannot. Call it once, at a program's start.

    A helper killed while it takes a pipe from us (multiprocessing's resource sharer hands it over a socket, from a
    thread of ours) broke the handover, and the sharer printed the ConnectionResetError's traceback above the one
    line that says the helper died (``python -m dht``, 2 kills in 80); it is logged at debug level instead."""
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    if not getattr(sys.excepthook, "quiet_handovers", False):
        sys.excepthook = _quiet_handovers(sys.excepthook)


def _quiet_handovers(excepthook):
    def quiet(kind, error, trace) -> None:
        sharer = os.path.join("multiprocessing", "resource_sharer.py")
        if issubclass(kind, (ConnectionError, EOFError)) and any(
                frame.f_code.co_filename.endswith(sharer) for frame, _ in traceback.walk_tb(trace)):
            logger.debug(f"a helper process left while it took a pipe from us: {error!r}")
            return
        excepthook(kind, error, trace)

    quiet.quiet_handovers = True
    return quiet


def init_child_process() -> None:
    """Run first in every forked helper process (DHT, averager).

    Linux is asked to SIGKILL the child when its parent dies, so a peer killed with SIGKILL leaves no orphans
    behind. Then the child ignores SIGTERM: the parent decides when it stops, and stops it (``stop_process``).
    torchrun, systemd and ``pkill -f "python -m peer"`` send SIGTERM to every process of the peer at once; a
    child that died of it left the parent's sync waiting on it until its deadline, past torchrun's 30 s grace
    for a SIGTERMed rank (no checkpoint, no line). Where no parent-death signal can be set (not Linux), SIGTERM
    goes back to its default, so that nothing outlives the peer: a handler inherited from the parent would only
    set a flag in this copy of the process and keep it alive.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except (OSError, AttributeError):  # not Linux: no libc.so.6, or no prctl in it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stop_process(component) -> None:
    """Shut down a hivemind process (a DHT, an averager): its own shutdown, and SIGKILL should it outlive it
    (it ignores SIGTERM, which hivemind's shutdown falls back on)."""
    if not component.is_alive():
        return
    component.shutdown()
    if component.is_alive():
        component.kill()
        component.join(1.0)


def _daemon_preexec() -> None:
    """Runs in the forked p2p daemon before exec: its own process group, death with its parent, and SIGTERM (which
    hivemind stops it with) back to its default: its parent ignores it (``init_child_process``), and exec keeps
    an ignored signal ignored."""
    os.setpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux (macOS): the daemon stops with hivemind's shutdown instead


def spawn_daemon_detached() -> None:
    """Make the p2p daemon this process starts survive a terminal's Ctrl+C and die with us.

    Ctrl+C signals the whole foreground process group; the daemon (Go) would exit at once, and the
    peer could no longer finish its all-reduce, announce that it leaves, or shut down without
    tracebacks. In its own group it only stops when we stop it, or when this process dies.
    """
    spawn = asyncio.subprocess.create_subprocess_exec

    async def spawn_detached(*args, **kwargs):
        kwargs.setdefault("preexec_fn", _daemon_preexec)
        return await spawn(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = spawn_detached


def part_died(part: str) -> str:
    """The line for a node whose ``part`` died (its p2p daemon, its DHT's process, a peer's averager's)."""
    return (f"this node's {part} died (killed, or out of memory?), and with it the node's link to the swarm; "
            f"start it again (a peer with --checkpoint-dir resumes from its last round)")


class LinkLost(UserError):
    """A helper process of this node died (its p2p daemon, its DHT's or averager's process), and with it the node's
    link to the swarm: what we wait for will never come. Its text is the user's line (``part_died``), which every
    command prints as it prints any ``UserError``."""


def check_alive(helper, part: str) -> None:
    """Raise ``LinkLost`` if ``helper`` (a process we started, known to the user as ``part``) has died."""
    if not helper.is_alive():
        raise LinkLost(part_died(part))


def answer(future: concurrent.futures.Future, helper, part: str, timeout: Optional[float]) -> Any:
    """The result of ``future``, which only ``helper`` can resolve: ``LinkLost`` as soon as the helper is found dead
    (a SIGKILLed averager held its caller until each call's timeout: a minute, twice over), and
    ``concurrent.futures.TimeoutError`` after ``timeout`` seconds (None: none). A helper that answered and then
    exited (a DHT that could not start says why, and ends) is given a moment for its answer to come through."""
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(min(DEATH_POLL, deadline - time.monotonic()), 0.0))
        except concurrent.futures.TimeoutError:  # (not TimeoutError before Python 3.11)
            if not helper.is_alive():
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    return future.result(timeout=DEATH_POLL)
                raise LinkLost(part_died(part)) from None
            if time.monotonic() >= deadline:
                raise


@contextlib.contextmanager
def holding(lock, helper, part: str) -> Iterator[None]:
    """Hold ``lock``, which ``helper`` shares with us: ``LinkLost`` if the helper dies meanwhile, which it may have
    done holding the lock, releasing it never."""
    while not lock.acquire(timeout=DEATH_POLL):
        check_alive(helper, part)
    try:
        yield
    finally:
        lock.release()
