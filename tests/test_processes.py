"""Helper processes (``dht/processes.py``): every program forks them, and a wait on one that died ends at once,
naming it.

Real forked processes, SIGKILLed as the kernel's OOM killer would: a peer's averager that died that way held the sync
waiting on it for a minute, and one that died holding the buffers' lock would have held it for good.
"""

import concurrent.futures
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

import dht.__main__
import peer.__main__
from dht.errors import UserError
from dht.processes import DEATH_POLL, LinkLost, answer, holding
from tests.harness.swarm import ROOT

fork = mp.get_context("fork")


def test_every_program_forks_its_helpers_where_another_start_method_is_the_default(monkeypatch):
    """Python 3.14 makes forkserver the default on Linux, which must pickle a helper, and hivemind's cannot be: the
    peer, its commands (``export`` starts an averager) and the bootstrap node each set fork before they start one."""
    seen = {}

    def record(program):
        def look(*_):
            seen[program] = mp.get_start_method()
            raise UserError("stop here")
        return look

    monkeypatch.setitem(sys.modules, "peer.use.export", types.SimpleNamespace(main=record("export")))
    monkeypatch.setattr(peer.__main__, "parse_args", record("peer"))
    monkeypatch.setattr(dht.__main__, "parse_args", record("dht"))
    runs = {"export": lambda: peer.__main__.main(["export"]), "peer": lambda: peer.__main__.main([]),
            "dht": lambda: dht.__main__.main([])}
    try:
        for program, run in runs.items():
            mp.set_start_method("forkserver", force=True)
            with pytest.raises(UserError) if program == "export" else contextlib.nullcontext():
                run()
    finally:
        mp.set_start_method("fork", force=True)  # the suite's (tests/conftest.py)
    assert seen == {"export": "fork", "peer": "fork", "dht": "fork"}


def sleeper():
    helper = fork.Process(target=time.sleep, args=(60,), daemon=True)
    helper.start()
    return helper


def test_a_wait_on_a_helper_ends_as_soon_as_it_dies_and_names_it():
    helper, future = sleeper(), concurrent.futures.Future()
    try:
        threading.Timer(0.2, future.set_result, args=("answered",)).start()  # a live helper's answer comes back
        assert answer(future, helper, "averaging process", timeout=30) == "answered"
        with pytest.raises(concurrent.futures.TimeoutError):  # a live helper that does not answer: its timeout
            answer(concurrent.futures.Future(), helper, "averaging process", timeout=0.3)
        threading.Timer(0.2, helper.kill).start()
        started = time.monotonic()
        with pytest.raises(LinkLost, match="^this node's averaging process died .* start it again"):
            answer(concurrent.futures.Future(), helper, "averaging process", timeout=60)
        assert time.monotonic() - started < 0.2 + 4 * DEATH_POLL  # not the 60 s timeout
    finally:
        helper.kill()
        helper.join()


def hold_and_die(lock):
    lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_lock_held_by_a_helper_that_died_holding_it_fails_the_wait_naming_it():
    lock = fork.Lock()
    helper = fork.Process(target=hold_and_die, args=(lock,), daemon=True)
    helper.start()
    helper.join()
    with pytest.raises(LinkLost, match="^this node's averaging process died"):
        with holding(lock, helper, "averaging process"):
            pass
    # a live helper's lock is taken once it lets go, and given back after
    helper, lock = sleeper(), fork.Lock()
    try:
        lock.acquire()
        threading.Timer(0.2, lock.release).start()
        with holding(lock, helper, "averaging process"):
            assert not lock.acquire(block=False)
        assert lock.acquire(block=False)
    finally:
        helper.kill()
        helper.join()


# a helper that dies in the middle of taking a pipe from this process (multiprocessing's resource sharer hands it over
# a socket, from a thread of ours), then a whole handover after it, so that the broken one has been served
BROKEN_HANDOVER = """
import os, socket, struct, sys
from multiprocessing import resource_sharer
if sys.argv[1] == "program":
    from dht.processes import fork_children
    fork_children()
r, w = os.pipe()
resource_sharer.DupFd(r)
with socket.socket(socket.AF_UNIX) as s:
    s.connect(resource_sharer._resource_sharer._address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
os.close(resource_sharer.DupFd(w).detach())
1 / 0
"""


@pytest.mark.parametrize("started_as", ["program", "bare"])
def test_a_helper_that_dies_taking_a_pipe_from_us_prints_no_traceback(started_as):
    """``python -m dht`` printed a ConnectionResetError's traceback from multiprocessing's resource sharer above its
    line that said its DHT process died (2 kills in 80). Our programs' other errors still reach the hook."""
    result = subprocess.run([sys.executable, "-c", BROKEN_HANDOVER, started_as], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert "ZeroDivisionError" in result.stderr, result.stderr
    assert ("resource_sharer" in result.stderr) == (started_as == "bare"), result.stderr
