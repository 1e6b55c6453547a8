"""One round's sync in flight: run right here, or on a background thread while the next round trains (overlap).

``start_overlap`` and ``sync_round`` are the node's steps around it (``Peer._launch``), which ``bench/scale.py``'s
simulated peers call too."""

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


def start_overlap(local, synchronizer, clock) -> None:
    """Before a sync that runs while the next round trains: freeze theta for it, train that round from the eager
    outer step, and have the sync wait for that round's plan (``clock.planned``), which it tells its group."""
    local.freeze(with_moments=synchronizer.has_moment)
    local.start(synchronizer.outer.eager_target())
    clock.planned.clear()


def sync_round(synchronizer, clock, tokens: int, rounds: int, budget: float, step_seconds: float,
               meet_at: Optional[float], overlap: bool) -> SyncResult:
    """A round's sync: ``rounds`` rounds of pending work (``tokens``), its group meeting at ``meet_at``. With
    overlap it shares the plan of the round now training and then lines that round's end up with the group's."""
    if overlap:  # the next round's plan first: this sync shares it with the group
        clock.planned.wait(timeout=10.0)
    result = synchronizer.sync(tokens, budget, missed_rounds=rounds - 1, step_seconds=step_seconds,
                               planned_end=(lambda: clock.target) if overlap else (lambda: None),
                               meet_at=meet_at, overlapped=overlap)
    if overlap and not result.applied:
        # the round in progress was planned before this sync caught up (or found no group): line its end up with
        # the swarm's, or we reach the next sync out of step with everyone again
        clock.realign()
    elif overlap and result.round_end is not None:
        clock.retarget(result.round_end)  # the group ends the round in progress together
    if overlap:
        # the sync is over, and our record says so, with the plan of the round in progress. It said "syncing" until
        # that round's end: a peer that adopted our state took us for a group waiting for it and ended its round at
        # once, to meet nobody, and a joiner lined up with a plan we had since given up
        clock.publish(clock.plan())
    return result
