"""One round's sync in flight: run right here, or on a background thread while the next round trains (overlap)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

from peer.round.sync import SyncResult


class InFlight:
    """A round's sync, with what it was started with."""

    def __init__(self, stats, tokens: int, rounds: int):
        self.stats, self.tokens, self.rounds = stats, tokens, rounds
        self.started = self.finished = time.monotonic()
        self.done = threading.Event()
        self.result: Optional[SyncResult] = None
        self.error: Optional[BaseException] = None

    def start(self, sync: Callable[[], SyncResult], background: bool) -> None:
        def run():
            try:
                self.result = sync()
            except BaseException as e:  # re-raised in the training thread by wait()
                self.error = e
            finally:
                self.finished = time.monotonic()
                self.done.set()

        if background:
            threading.Thread(target=run, name="sync", daemon=True).start()
        else:
            run()

    def running(self) -> bool:
        return not self.done.is_set()

    def merged(self) -> Tuple[int, int]:
        """(tokens, rounds) of pending work this sync merged: none while it runs, if it failed, or if not applied."""
        applied = self.done.is_set() and self.error is None and self.result is not None and self.result.applied
        return (self.tokens, self.rounds) if applied else (0, 0)

    def wait(self) -> SyncResult:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result
