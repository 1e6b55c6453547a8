"""Fault plans as data, for tests: ``KIND@PHASE:EPOCH``, e.g. ``kill@allreduce:3``.

- kinds: ``kill`` (SIGKILL the whole peer: its process group, or the main process and with it every
  child, which die with their parent)
- phases: ``inner`` (during the inner steps of the round that starts at EPOCH) and ``allreduce``
  (while sending parts in the all-reduce of EPOCH's round)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

KINDS = ("kill",)
PHASES = ("inner", "allreduce")


@dataclass(frozen=True)
class FaultPlan:
    kind: str
    phase: str
    epoch: int
    main_pid: int

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["FaultPlan"]:
        if not text:
            return None
        try:
            kind, rest = text.split("@", 1)
            phase, epoch = rest.split(":", 1)
            plan = cls(kind, phase, int(epoch), os.getpid())
        except ValueError:
            raise ValueError(f"fault_plan must look like kill@allreduce:3, got {text!r}") from None
        if kind not in KINDS or phase not in PHASES:
            raise ValueError(f"fault_plan {text!r}: kind must be one of {KINDS}, phase one of {PHASES}")
        return plan

    def fire(self, phase: str, epoch: int) -> None:
        if phase != self.phase or epoch != self.epoch:
            return
        if os.getpgid(self.main_pid) == self.main_pid:
            os.killpg(self.main_pid, signal.SIGKILL)  # the peer leads its own process group: take it all
        os.kill(self.main_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
