"""A round's metrics record: one JSON line per round (docs/design.md, "Metrics"), the peer's observable interface."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple


def round_record(parts, job, result, sync_seconds: float, eval_loss: Optional[float], traffic: Tuple[int, int],
                 overlap: bool) -> Dict[str, Any]:
    """The record of the round whose sync ``job`` just finished with ``result``."""
    stats, state, trainer = job.stats, parts.state, parts.trainer
    return dict(
        epoch=state.epoch, time=time.time(), peer_id=parts.peer_id, round=parts.progress.rounds, loss=stats.loss,
        eval_loss=eval_loss, tokens=stats.tokens, tokens_total=state.tokens_total,
        inner_steps=stats.steps, group_size=len(result.group), group=list(result.group), groups=result.groups,
        state_hash=state.hash(), bytes_sent=traffic[0], bytes_received=traffic[1],
        compute_seconds=stats.compute_seconds, sync_seconds=sync_seconds, stale=job.rounds - 1,
        rebased=result.rebased, applied=result.applied, attempts=result.attempts, aligned=result.aligned,
        lr=stats.lr, tokens_per_second=stats.tokens / max(stats.compute_seconds, 1e-9), error=result.error,
        outcome=result.outcome.value if result.outcome is not None else None,
        offences=result.offences, reduced=round(result.reduced, 4), peak_memory_bytes=trainer.peak_memory(),
        device=str(trainer.device),
        overlap=overlap, sync_wall_seconds=job.finished - job.started,
        sync_deadline=result.deadline, sync_waited_seconds=result.waited,
        sync_catch_up_seconds=result.catch_up_seconds, sync_averaging_seconds=result.averaging_seconds,
        sync_allreduce_seconds=result.allreduce_seconds,
        next_round_seconds=result.next_round_seconds, round_stretch=result.stretch,
    )
