"""Optional experiment trackers: TensorBoard and Weights & Biases get every round's numbers.

Neither is a dependency. Asking for one that is not installed is a one-line error at start-up; a
tracker that fails later (a full disk, say) is logged once and dropped, and training goes on.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Dict, List, Optional

from dht.errors import UserError

logger = logging.getLogger(__name__)


class Tracker:
    def log(self, record: Dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """The record's numbers (booleans and None left out), keyed as in the metrics file."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and k not in ("round", "time")}


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir)

    def log(self, record: Dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(f"peer/{name}", value, global_step=record["round"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, project: str, name: str, config: Dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install wandb (WANDB_MODE=offline works "
                            "without an account)") from None
        self.run = wandb.init(project=project, name=name, config=config)

    def log(self, record: Dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["round"])

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker the flags asked for; ``log`` never raises."""

    def __init__(self, trackers: Optional[List[Tracker]] = None):
        self.trackers = list(trackers or [])

    @classmethod
    def from_flags(cls, tensorboard: Optional[str], wandb: Optional[str], name: str,
                   config: Dict[str, Any]) -> "Trackers":
        trackers: List[Tracker] = []
        if tensorboard:
            trackers.append(TensorBoardTracker(tensorboard))
        if wandb:
            trackers.append(WandbTracker(wandb, name, config))
        return cls(trackers)

    def log(self, record: Dict[str, Any]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(record)
            except Exception as e:
                logger.error(f"{type(tracker).__name__} failed ({e!r}); no longer logging to it, training goes on")
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as e:
                logger.debug(f"closing {type(tracker).__name__}: {e!r}")
