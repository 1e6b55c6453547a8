"""Stopping on a signal: Ctrl+C or SIGTERM asks the training thread to leave after its current step (checkpoint,
then exit); a second one quits at once.

Python runs signal handlers on the main thread, between two bytecodes. A training thread stuck in one native call
(a collective of an island whose other rank is gone, a hung device) never gets there, and would end with no word:
torchrun, for one, follows its SIGTERM with a SIGKILL 30 s later. So each signal also wakes a watch thread
(``signal.set_wakeup_fd``). When the handler has not run ``stuck_seconds`` after a signal, the training thread is
stuck: the watch thread says where, and leaves for it (``leave_stuck``), without the round in progress.

A training thread that took the signal can still block afterwards, in its step's collective. Where the process has
calls that only another process ends (an island's collectives), ``blocked_for`` says how long the training thread
has been in one; once a stop is asked, one that lasts ``stuck_seconds`` is stuck too (the watch thread looks every
second). Other long waits (a sync in flight, the last checkpoint) end on their own deadlines, and are left alone.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

STUCK_SECONDS = 10.0  # a main thread that takes no signal for this long is stuck in a native call
TICK_SECONDS = 1.0  # how often the watch thread asks ``blocked_for`` once a stop is asked
SIGNALS = (signal.SIGINT, signal.SIGTERM)
ROOT = Path(__file__).resolve().parents[2]


class StopOnSignals:
    """Install with ``StopOnSignals(stop_requested, say, leave_stuck)`` on the main thread.

    ``say(line)`` tells the user; ``leave_stuck(signal_name, where)`` runs on the watch thread when the training
    thread is stuck, and does not return (it exits the process); ``blocked_for()``: seconds the training thread has
    been in a call that only another process ends, 0 when it is in none."""

    def __init__(self, stop_requested: threading.Event, say: Callable[[str], None],
                 leave_stuck: Callable[[str, str], None], stuck_seconds: float = STUCK_SECONDS,
                 blocked_for: Optional[Callable[[], float]] = None):
        self.stop_requested, self.say, self.leave_stuck = stop_requested, say, leave_stuck
        self.stuck_seconds, self.blocked_for = stuck_seconds, blocked_for
        self._taken_r, self._taken_w = os.pipe()  # the handler writes a byte here each time it runs
        wake_r, wake_w = os.pipe()  # Python's own C-level handler writes the signal's number here, on any thread
        os.set_blocking(wake_w, False)
        for sig in SIGNALS:
            signal.signal(sig, self._handler)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(wake_r,), name="signal-watch", daemon=True).start()

    def _handler(self, signum, _frame) -> None:
        if self.stop_requested.is_set():
            os._exit(130)  # children die with us
        self.stop_requested.set()
        self.say(f"{signal.Signals(signum).name}: leaving after the current step (checkpoint, then exit); "
                 f"press Ctrl+C again to quit at once")
        os.write(self._taken_w, b"\0")  # last: what the watch thread says next comes after the line above

    def _watch(self, wake_fd: int) -> None:
        received = taken = 0
        first: Optional[signal.Signals] = None
        since: Optional[float] = None  # when the oldest signal the handler has not taken came
        while True:
            if since is not None:
                timeout: Optional[float] = max(0.0, since + self.stuck_seconds - time.monotonic())
            else:
                timeout = TICK_SECONDS if taken and self.blocked_for is not None else None
            readable, _, _ = select.select([wake_fd, self._taken_r], [], [], timeout)
            if wake_fd in readable:
                for number in os.read(wake_fd, 64):
                    if number in SIGNALS:
                        received += 1
                        first = first or signal.Signals(number)
                        since = since or time.monotonic()
            if self._taken_r in readable:
                taken += len(os.read(self._taken_r, 64))
            if taken >= received:
                since = None
                if taken and self.blocked_for is not None and self.blocked_for() >= self.stuck_seconds:
                    self.leave_stuck(first.name, where_main_thread_is())  # took the stop, then blocked
                    return
            elif received - taken >= 2:
                os._exit(130)  # a second Ctrl+C that the stuck thread cannot take either: quit at once
            elif not readable:
                self.leave_stuck(first.name, where_main_thread_is())
                return


def where_main_thread_is() -> str:
    """The main thread's innermost call, and the innermost call of ours that led to it: 'broadcast
    (distributed_c10d.py:2830), from command (peer/train/island.py:113)'."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown call"
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    said = f"{inner.name} ({Path(inner.filename).name}:{inner.lineno})"
    ours = next((f for f in reversed(stack) if _ours(f.filename)), None)
    if ours is not None and ours is not inner:
        said += f", from {ours.name} ({Path(ours.filename).relative_to(ROOT)}:{ours.lineno})"
    return said


def _ours(filename: str) -> bool:
    path = Path(filename)
    return path.is_relative_to(ROOT / "peer") or path.is_relative_to(ROOT / "dht")  # where our waits are
