"""The swarm's helper processes: hivemind's DHT and averager, forked, and the p2p daemons they start, all of them
gone when the peer is, however it ends.

- ``fork_children``: the start method hivemind is built on, set once at a program's start;
- ``init_child_process``: first thing in every forked helper: die with the parent, and leave SIGTERM to it;
- ``stop_process``: shut a helper down, and SIGKILL it should it outlive that;
- ``spawn_daemon_detached``: the p2p daemon in its own process group (a terminal's Ctrl+C is the peer's to handle),
  dying with the process that started it.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal


def fork_children() -> None:
    """Start hivemind's processes (the DHT, the averager) by fork, the start method hivemind is built on: a child
    inherits its parent's objects (closures, shared tensors, the running DHT), which forkserver, Python 3.14's
    default on Linux, and spawn would have to pickle, and cannot. Call it once, at a program's start."""
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)


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
