"""Optional experiment trackers: TensorBoard and Weights & Biases get every round's numbers.

Both are grouped by run, with the epoch as the step: every peer of a run counts the same epochs, so one run's peers
line up on one axis, and a restarted peer continues its line (its round count starts again at 1; its epoch does
not). TensorBoard writes one directory per peer under the run's (``DIR/RUN_ID/PEER_ID``); W&B puts a run's peers
in one group (``group=run_id``), each its own W&B run whose id derives from its peer id, resumed after a restart.

Neither is a dependency. Asking for one that is not installed is a one-line error at start-up; a
tracker that fails later (a full disk, say) is logged once and dropped, and training goes on.
"""

from __future__ import annotations

import logging
import numbers
from pathlib import Path
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


def wandb_id(run_id: str, peer_id: str) -> str:
    """The W&B run id of a peer of a run: the same after a restart (its identity is kept), another in another run
    (a W&B run resumed by a run of fewer epochs would drop every step below its last)."""
    return f"{run_id[:40]}-{peer_id}"


class TensorBoardTracker(Tracker):
    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
        self.writer = SummaryWriter(log_dir)

    def log(self, record: Dict[str, Any]) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(f"peer/{name}", value, global_step=record["epoch"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, project: str, run_id: str, peer_id: str, config: Dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install wandb (WANDB_MODE=offline works "
                            "without an account)") from None
        self.run = wandb.init(project=project, group=run_id, id=wandb_id(run_id, peer_id), resume="allow",
                              name=f"{run_id}-{peer_id[-8:]}", job_type="peer", config=config)
        self.last_epoch = -1

    def log(self, record: Dict[str, Any]) -> None:
        # W&B keeps a step's values until a later step comes and drops a step below the last: a peer that adopts a
        # state of fewer epochs (the fork choice counts tokens) logs at its last epoch until it passes it again
        self.last_epoch = max(self.last_epoch, int(record["epoch"]))
        self.run.log(scalars(record), step=self.last_epoch)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Every tracker the flags asked for; ``log`` never raises."""

    def __init__(self, trackers: Optional[List[Tracker]] = None):
        self.trackers = list(trackers or [])

    @classmethod
    def from_flags(cls, tensorboard: Optional[str], wandb: Optional[str], run_id: str, peer_id: str,
                   config: Dict[str, Any]) -> "Trackers":
        trackers: List[Tracker] = []
        if tensorboard:
            trackers.append(TensorBoardTracker(str(Path(tensorboard) / run_id / peer_id)))
        if wandb:
            trackers.append(WandbTracker(wandb, run_id, peer_id, config))
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
