"""What a frozen holder costs a joiner's state download: two holders, both live or one SIGSTOPped, side by side.

    python -m bench.frozen_holder --repeats 3 --out bench/results/frozen_holder.md

Two peers train on loopback (tests' fast settings: micro model, H = 5) with ``--quorum 2``, so that neither steps on
alone once the other is frozen, until both hold epoch 10 (``REPLAY_ROUNDS`` + 2): past what a joiner replays, so it
downloads the state. Then, in the ``frozen`` arm, one of them is SIGSTOPped (its record still says it holds the
state), and a joiner starts from nothing and downloads the state from both. The ``live`` arm freezes nobody. The
part timeout is the product's default (15 s). Reported: the download's seconds, from the joiner's "downloading the
state" line to its "adopted" line (whole seconds: the log's resolution), and the donors it used. The arms alternate
(live, frozen, live, ...).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List

from peer.round.catchup import REPLAY_ROUNDS
from tests.harness.swarm import Swarm, signal_group, wait_until

FLAGS = ("--quorum", "2", "--part-timeout", "15", "--allreduce-timeout", "60")
EPOCH = REPLAY_ROUNDS + 2  # past what a joiner replays: it downloads the state instead


def seconds(stderr: str, marker: str) -> datetime.datetime:
    line = next(line for line in stderr.splitlines() if marker in line)
    return datetime.datetime.strptime(line[:8], "%H:%M:%S")


def download(frozen: bool, root: Path) -> dict:
    root.mkdir(parents=True)
    swarm = Swarm(root)
    try:
        holders = [swarm.peer(f"h{i}", *FLAGS) for i in range(2)]
        wait_until(lambda: all(any(r["epoch"] >= EPOCH for r in h.metrics) for h in holders), 300, f"epoch {EPOCH}")
        if frozen:
            signal_group(holders[1], signal.SIGSTOP)
        joiner = swarm.peer("joiner", *FLAGS)
        wait_until(lambda: "adopted epoch" in joiner.stderr or "could not download" in joiner.stderr, 180,
                   "the joiner's download")
        stderr = joiner.stderr
    finally:
        swarm.close()  # SIGKILLs every process group, a stopped one too
    if "downloading the state" not in stderr or "downloaded from" not in stderr:
        raise SystemExit(f"the joiner did not download the state:\n{stderr[-2000:]}")
    took = (seconds(stderr, "adopted epoch") - seconds(stderr, "downloading the state")).total_seconds()
    used = int(stderr.split("downloaded from ")[1].split(" ")[0])
    return dict(arm="frozen" if frozen else "live", seconds=took, donors=used)


def report(rows: List[dict], argv: List[str]) -> str:
    lines = ["# A frozen holder and a joiner's state download", "",
             f"    python -m bench.frozen_holder {shlex.join(argv)}", "",
             f"Two holders at epoch {EPOCH} (micro, loopback, `--quorum 2`, part timeout 15 s); in `frozen`, one is "
             "SIGSTOPped before the joiner starts. Seconds from the joiner's \"downloading the state\" line to its "
             "\"adopted\" line (whole seconds).", "",
             "| arm | downloads | seconds (each) | mean | donors used |", "|---|---|---|---|---|"]
    for arm in ("live", "frozen"):
        mine = [r for r in rows if r["arm"] == arm]
        each = ", ".join(f"{r['seconds']:.0f}" for r in mine)
        lines.append(f"| {arm} | {len(mine)} | {each} | "
                     f"{statistics.mean(r['seconds'] for r in mine):.1f} | "
                     f"{', '.join(str(r['donors']) for r in mine)} |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="frozen-holder-") as tmp:
        for repeat in range(args.repeats):
            for frozen in (False, True):
                rows.append(download(frozen, Path(tmp) / f"{repeat}-{int(frozen)}"))
                print(rows[-1], flush=True)
    text = report(rows, argv)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
