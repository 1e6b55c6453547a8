"""A real peer with a test harness's hooks: ``python -m peer`` plus a fault plan or misbehaviour.

    python -m tests.harness --fault-plan kill@send:3 [PEER FLAGS...]
    python -m tests.harness --byzantine scale:1000 [PEER FLAGS...]
    python -m tests.harness --start-method forkserver [PEER FLAGS...]   # Python 3.14's default on Linux

Everything but these flags goes to ``peer.__main__.main`` unchanged; the peer runs as it would under
``python -m peer``, with ``HarnessHooks`` in place of the product's no-op hooks.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from typing import Optional, Sequence

import torch

from peer.hooks import Hooks
from tests.harness.faults import FaultPlan
from tests.harness.misbehaviour import Misbehaviour


class HarnessHooks(Hooks):
    def __init__(self, plan: Optional[FaultPlan], misbehaviour: Optional[Misbehaviour]):
        self.plan, self.misbehaviour = plan, misbehaviour

    def at(self, phase: str, epoch: int) -> None:
        if self.plan is not None:
            self.plan.fire(phase, epoch)

    def outgoing(self, delta: torch.Tensor) -> None:
        if self.misbehaviour is not None:
            self.misbehaviour.apply(delta)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault-plan", help="e.g. kill@send:3 or freeze@inner:2+5 (tests/harness/faults.py)")
    parser.add_argument("--byzantine", help="'nan' or 'scale:FACTOR' (tests/harness/misbehaviour.py)")
    parser.add_argument("--start-method", help="set multiprocessing's start method before the peer starts")
    args, peer_argv = parser.parse_known_args(argv)
    if args.start_method:
        multiprocessing.set_start_method(args.start_method)
    try:
        hooks = HarnessHooks(FaultPlan.parse(args.fault_plan), Misbehaviour.parse(args.byzantine))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from peer.__main__ import main as peer_main

    return peer_main(peer_argv, hooks=hooks)


if __name__ == "__main__":
    sys.exit(main())
