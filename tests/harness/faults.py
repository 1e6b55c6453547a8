"""Fault plans as data (like torchft's EventInjector), struck through the peer's hooks (``peer/hooks.py``).

A plan is a comma-separated list of events ``KIND@PHASE:EPOCH[+SECONDS]``, e.g. ``kill@send:3`` or
``freeze@inner:2+6,slow@reduce:5+8``. Each event strikes once, at the first time this peer reaches
PHASE in a round at or after EPOCH.

Kinds:
- ``kill``: SIGKILL the whole peer (its process group: main process, averager, DHT, p2p daemon); with +SECONDS,
  after holding the thread that reached PHASE that long while the rest of the peer runs on (``kill@checkpoint:2+2``:
  the round's checkpoint stays unwritten, while the averager finishes sending the round's parts to its groupmates);
- ``die``: SIGKILL only the process that reached PHASE (at ``send``, ``reduce`` or ``donor``: the peer's averager
  process, as the kernel's OOM killer might pick it; the rest of the peer runs on);
- ``stop``: Ctrl+C, as a terminal sends it: SIGINT to the whole peer (its processes but the p2p daemon, which runs in
  a group of its own);
- ``freeze``: SIGSTOP the whole peer for SECONDS, then SIGCONT;
- ``slow``: throttle the whole peer to a quarter of its speed for SECONDS (stopped 3/4 of the time);
- ``partition``: take this peer's network links down for SECONDS, then up again. The peer must run in a
  network namespace of its own (``docker/netns.py``), where it is root over its own links.
A detached helper process (its own session, so the freeze does not stop it) resumes the peer or
restores its links; a peer never waits on the helper.

Phases are the hooks' (``peer.hooks.PHASES``): ``inner``, ``matchmaking``, ``send``, ``reduce``, ``donor`` and
``checkpoint``. Events at ``inner``, ``matchmaking`` and ``checkpoint`` fire in the peer's main process, those at
``send``, ``reduce`` and ``donor`` in its averager process; each process keeps its own copy of the plan.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import List, Optional

from peer.hooks import PHASES

logger = logging.getLogger(__name__)

KINDS = ("kill", "die", "stop", "freeze", "slow", "partition")
EVENT = re.compile(r"^(?P<kind>\w+)@(?P<phase>\w+):(?P<epoch>\d+)(?:\+(?P<seconds>\d+(?:\.\d+)?))?$")
SLOW_DUTY = (0.3, 0.1)  # seconds stopped, seconds running: a quarter of the speed


@dataclass
class FaultEvent:
    kind: str
    phase: str
    epoch: int
    seconds: float = 0.0
    fired: bool = False


class FaultPlan:
    def __init__(self, events: List[FaultEvent], group: int):
        self.events, self.group = events, group

    @classmethod
    def parse(cls, text: Optional[str]) -> Optional["FaultPlan"]:
        if not text:
            return None
        events = []
        for item in text.split(","):
            match = EVENT.match(item.strip())
            if match is None:
                raise ValueError(f"fault_plan event {item!r} must look like kill@send:3 or freeze@inner:2+5")
            kind, phase = match["kind"], match["phase"]
            if kind not in KINDS or phase not in PHASES:
                raise ValueError(f"fault_plan event {item!r}: kind must be one of {KINDS}, phase one of {PHASES}")
            seconds = float(match["seconds"] or 0)
            if kind not in ("kill", "die", "stop") and seconds <= 0:
                raise ValueError(f"fault_plan event {item!r}: {kind} needs a duration, e.g. {kind}@{phase}:3+5")
            events.append(FaultEvent(kind, phase, int(match["epoch"]), seconds))
        if os.getpgid(0) != os.getpid():
            raise ValueError("fault plans strike the peer's whole process group: start the peer as a group leader "
                             "(setsid, or a new session)")
        if any(e.kind == "partition" for e in events) and not own_network_namespace():
            raise ValueError("partition faults take the peer's links down: run it in a namespace (docker/netns.py)")
        return cls(events, os.getpid())

    def fire(self, phase: str, epoch: int) -> None:
        for event in self.events:
            if not event.fired and event.phase == phase and epoch >= event.epoch:
                event.fired = True
                logger.warning(f"fault plan: {event.kind} at {phase}, epoch {epoch}"
                               + (f", for {event.seconds:g}s" if event.seconds else ""))
                self._strike(event)

    def _strike(self, event: FaultEvent) -> None:
        group, seconds = self.group, event.seconds
        if event.kind == "kill":
            time.sleep(seconds)
            os.killpg(group, signal.SIGKILL)
        elif event.kind == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif event.kind == "stop":
            os.killpg(group, signal.SIGINT)
        elif event.kind == "freeze":
            _detached(f"sleep {seconds}; kill -CONT -{group}")
            os.killpg(group, signal.SIGSTOP)
        elif event.kind == "slow":
            stopped, running = SLOW_DUTY
            _detached(f"end=$(($(date +%s) + {int(seconds)})); while [ $(date +%s) -lt $end ]; do "
                      f"kill -STOP -{group}; sleep {stopped}; kill -CONT -{group}; sleep {running}; done; "
                      f"kill -CONT -{group}")
        elif event.kind == "partition":
            links = [name for name in os.listdir("/sys/class/net") if name != "lo"]
            downs = "; ".join(f"ip link set dev {name} down" for name in links)
            ups = "; ".join(f"ip link set dev {name} up" for name in links)
            subprocess.run(["sh", "-c", downs], check=True)
            _detached(f"sleep {seconds}; {ups}")


def _detached(script: str) -> None:
    subprocess.Popen(["sh", "-c", script], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def own_network_namespace() -> bool:
    """True if this process runs in a named network namespace (``ip netns``), never the host's."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        return any(os.stat(os.path.join("/run/netns", name)).st_ino == mine for name in os.listdir("/run/netns"))
    except OSError:
        return False
