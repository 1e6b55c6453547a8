"""A node's checkpoints: when one is due, what it holds, and how it reaches the disk.

    checkpoints = Checkpoints(parts, node, hooks, mid_round=island is None)   # after the process's last fork
    if checkpoints.due():
        checkpoints.save(round_tokens=..., round_steps=...)                    # between two inner steps
    checkpoints.close()                                                        # waits for the last write

A checkpoint is a snapshot of everything a restart resumes from, copied in memory under the state's lock and written
by ``CheckpointWriter``'s thread while training goes on. A copy that would not fit in memory is not taken: the
training thread then writes the live tensors itself, under the lock (docs/design.md, "Checkpoints").
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Tuple

from peer.config import NodeConfig
from peer.hooks import CHECKPOINT, Hooks
from peer.ops.checkpoint import CheckpointPayload, CheckpointWriter, frozen, memory_free, tensor_bytes
from peer.round.build import Parts

logger = logging.getLogger(__name__)
# a checkpoint's snapshot is taken only if this many times its size is free in memory; else the checkpoint is written
# from the live tensors, on the training thread (a 150m peer on a 24-GiB machine was OOM-killed writing its copy)
SNAPSHOT_HEADROOM = 1.25


class Checkpoints:
    """A node's checkpoints, in ``node.checkpoint_dir`` (none without one). ``mid_round`` False: only at a round's
    end (an island's rank 0 would save its ranks' tokens without them)."""

    def __init__(self, parts: Parts, node: NodeConfig, hooks: Hooks, mid_round: bool = True):
        self.parts, self.node, self.hooks, self.mid_round = parts, node, hooks, mid_round
        # started after the last fork of this process (the averager's, in build_parts): no thread runs across a fork
        self.writer = CheckpointWriter(node.checkpoint_dir) if node.checkpoint_dir else None
        self.saved_at = time.monotonic()
        self.wrote_in_place = False  # a checkpoint was written from the live tensors: said once

    def due(self) -> bool:
        """A mid-round checkpoint: ``--checkpoint-every`` seconds since the last one."""
        every = self.node.checkpoint_every
        return bool(self.writer and every and self.mid_round and time.monotonic() - self.saved_at >= every)

    def save(self, round_tokens: int = 0, round_steps: int = 0, merged: Tuple[int, int] = (0, 0)) -> None:
        """Save everything a restart resumes from. Mid-round, ``round_tokens`` trained in ``round_steps`` steps of
        the round in progress: they are in theta, and count in the contribution that the restart sends. ``merged``:
        (tokens, rounds) of pending work that a sync ended but not yet joined merged."""
        if self.writer is None:
            return
        self.saved_at = time.monotonic()
        size, free = snapshot_bytes(self.parts), memory_free()
        in_place = free is not None and size * SNAPSHOT_HEADROOM > free
        if in_place:
            if not self.wrote_in_place:
                logger.warning(f"checkpoints are written on the training thread: a copy of the state "
                               f"({size / 2**30:.1f} GiB) would not fit in the {free / 2**30:.1f} GiB of free memory, "
                               f"so training waits for the disk at each one (free some memory to write them in the "
                               f"background)")
                self.wrote_in_place = True
            self.writer.wait()  # first: a peer downloading our state waits for our write only, not for the last one
        # a copy is taken under the lock; in place, the live tensors stay under it until they are on disk: nothing
        # changes them meanwhile
        with self.parts.lock:
            payload = snapshot(self.parts, self.node.run_id, round_tokens, round_steps, merged=merged,
                               copy=not in_place)
            epoch = payload.epoch
            hook = None if round_steps else (lambda: self.hooks.at(CHECKPOINT, epoch))
            (self.writer.write_now if in_place else self.writer.submit)(payload, hook)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until the last checkpoint submitted is on disk (or ``timeout``)."""
        if self.writer is not None:
            self.writer.wait(timeout=timeout)

    def close(self) -> None:
        """Wait for the last write, then stop the writer's thread."""
        if self.writer is not None:
            self.writer.close()


def snapshot_bytes(parts: Parts) -> int:
    """What ``snapshot`` copies, in bytes (theta counted as G's size)."""
    state = parts.state
    return tensor_bytes([state.params, state.params, state.momentum, parts.feedback.residual, parts.lineage.carried,
                         parts.trainer.optimizer.state_dict()])


def snapshot(parts: Parts, run_id: str, round_tokens: int = 0, round_steps: int = 0,
             merged: Tuple[int, int] = (0, 0), copy: bool = True) -> CheckpointPayload:
    """Everything a restart resumes from, copied in memory (``frozen``), between two inner steps; the caller holds the
    state's lock: the steps after it and a peer's download (which reads G and m under the lock too) change nothing in
    it, and the checkpoint writer's thread puts it on disk while training goes on. Costs one copy of the state
    (docs/design.md, "Checkpoints"). ``merged``: (tokens, rounds) of pending work that a sync ended but not yet
    joined merged. With overlap, theta is saved as the sync's end leaves it (``LocalModel.settled``): less the eager
    step if it took none. ``copy`` False: the live tensors, for a caller that keeps the lock until they are written
    (``Checkpoints.save``, where a copy would not fit in memory)."""
    state, progress = parts.state, parts.progress
    take = frozen if copy else (lambda value: value)
    return CheckpointPayload(
        manifest_settings=dict(parts.manifest.settings), manifest_hash=parts.manifest.hash,
        manifest_record=parts.manifest.to_record(), run_id=run_id, peer_id=parts.peer_id,
        params=take(state.params), momentum=take(state.momentum), epoch=state.epoch,
        tokens_total=state.tokens_total, merged=dict(state.merged),
        theta=parts.local.settled(parts.layout.empty()),
        optimizer=take(parts.trainer.optimizer.state_dict()), local_steps=parts.trainer.local_steps,
        data_position=parts.stream.position, pending_tokens=progress.pending_tokens - merged[0] + round_tokens,
        round_steps=round_steps, pending_rounds=progress.pending_rounds - merged[1], rounds=progress.rounds,
        last_loss=progress.last_loss, residual=take(parts.feedback.residual),
        carried=take(parts.lineage.carried), recovered_tokens=parts.lineage.recovered_tokens,
    )
