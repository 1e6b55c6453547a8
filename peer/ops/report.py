"""What a peer tells its user and its tools: a progress bar, a line per round, a JSON line per round.

The JSON lines follow docs/design.md's metrics interface; tests and benchmarks read them.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from peer.ops.trackers import Trackers


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


class Reporter:
    def __init__(self, metrics_file: Optional[str], quiet: bool):
        self.trackers = Trackers()  # TensorBoard / W&B, set once the run's settings are known
        self.console = Console(stderr=True, highlight=False)
        self.show_bar = not quiet and self.console.is_terminal
        self.metrics_file = metrics_file
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
        self._progress: Optional[Progress] = None
        self._task = None

    def info(self, message: str) -> None:
        self.console.print(message, soft_wrap=True, markup=False)  # plain text: "[/ip4/...]" is an address

    # ---- the inner-step progress bar ----
    def start_round(self, epoch: int, total_steps: int) -> None:
        if not self.show_bar:
            return
        self._progress = Progress(
            TextColumn(f"epoch {epoch}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}  {task.fields[speed]:,.0f} tok/s"), TimeElapsedColumn(),
            console=self.console, transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("inner", total=total_steps, loss=float("nan"), speed=0.0)

    def step(self, steps: int, loss: float, tokens_per_second: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=steps, loss=loss, speed=tokens_per_second)

    def end_round(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # ---- per round ----
    def round(self, record: Dict[str, Any]) -> None:
        """One summary line for people, one JSON line for machines."""
        eval_part = f" | eval {record['eval_loss']:.3f}" if record.get("eval_loss") is not None else ""
        status = "" if record["applied"] else f" | not applied: {record.get('error') or 'no group'}"
        self.console.print(
            f"epoch {record['epoch']:>4} | loss {record['loss']:.3f}{eval_part} | group {record['group_size']} | "
            f"{record['tokens_per_second']:,.0f} tok/s | sent {human_bytes(record['bytes_sent'])} "
            f"recv {human_bytes(record['bytes_received'])} | sync {record['sync_seconds']:.1f}s | "
            f"{record['state_hash'][:8]}{status}",
            soft_wrap=True, markup=False,  # an error's text may hold "[/ip4/...]", which rich read as a closing tag
        )
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(_finite(record)) + "\n")
                f.flush()
        self.trackers.log(record)

    def close(self) -> None:
        self.end_round()
        self.trackers.close()


def _finite(record: Dict[str, Any]) -> Dict[str, Any]:
    """JSON has no NaN: write null instead."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
