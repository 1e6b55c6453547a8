"""Rounds of a real swarm, read from its peers' metrics files: how many peers applied each round, how many states
an epoch held, what share of peer time went to syncing, and whether any sync ran past its deadline.

    python -m bench.goodput --peers 16 --minutes 8 --systems swarm --schedules kill --inner-steps 60 \\
        --min-step-seconds 1 --batch-size 4 -- --model micro --threads 1 --seq-len 64 [--group-size 8]
    python -m bench.rounds /tmp/goodput_*/swarm/kill --label "one group" --out bench/results/scale-real.md

A round counts from the peers whose sync of it applied it (their record's epoch is the round's new epoch).
The first round and the last are left out: peers start and stop across them.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

DEADLINE_SLACK = 5.0  # seconds a sync may end past its budget: the final catch-up and the record's publication


def read(directory: Path) -> List[dict]:
    rows = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(dict(json.loads(line), file=path.stem))
    return rows


def summarize(rows: List[dict]) -> Dict[str, object]:
    applied = collections.defaultdict(list)
    for row in rows:
        if row["applied"]:
            applied[row["epoch"]].append(row)
    epochs = sorted(applied)[1:-1]
    total = sum(r["compute_seconds"] + r["sync_seconds"] for r in rows) or 1.0
    late = [r for r in rows if r.get("sync_deadline") and r["sync_wall_seconds"] > r["sync_deadline"] + DEADLINE_SLACK]
    losses = [statistics.mean(r["loss"] for r in applied[e]) for e in epochs]
    syncs = sorted(r["sync_seconds"] for r in rows)
    return dict(
        rounds=len(epochs),
        applied_min=min((len(applied[e]) for e in epochs), default=0),
        applied_median=statistics.median(len(applied[e]) for e in epochs) if epochs else 0,
        states=max((len({r["state_hash"] for r in applied[e]}) for e in epochs), default=0),
        sync_share=sum(r["sync_seconds"] for r in rows) / total,
        sync_median=statistics.median(syncs) if syncs else 0.0,
        sync_worst=syncs[-1] if syncs else 0.0,
        late=len(late), syncs=len(rows),
        loss_first=losses[0] if losses else float("nan"), loss_last=losses[-1] if losses else float("nan"),
        outcomes=collections.Counter(r.get("outcome") or "?" for r in rows if not r["applied"]),
        per_round=[len(applied[e]) for e in epochs],
    )


def table(labelled: Dict[str, Dict[str, object]]) -> str:
    lines = ["| run | rounds | peers applying a round (fewest / median) | states in one epoch (most) | sync share | "
             "sync s (median / worst) | syncs past their deadline | loss (first → last round) | syncs not applied |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, s in labelled.items():
        outcomes = ", ".join(f"{k} {v}" for k, v in s["outcomes"].most_common())
        lines.append(f"| {label} | {s['rounds']} | {s['applied_min']} / {s['applied_median']:.0f} | {s['states']} | "
                     f"{100 * s['sync_share']:.1f}% | {s['sync_median']:.1f} / {s['sync_worst']:.1f} | "
                     f"{s['late']} of {s['syncs']} | {s['loss_first']:.3f} → {s['loss_last']:.3f} | "
                     f"{outcomes or 'none'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rounds", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="directories of peers' metrics files (*.jsonl)")
    parser.add_argument("--label", action="append", default=[], help="a name for each directory, in order")
    parser.add_argument("--out", type=Path, help="also append the table here")
    args = parser.parse_args(argv)
    labels = args.label + [str(d) for d in args.dirs[len(args.label):]]
    summaries = {label: summarize(read(d)) for label, d in zip(labels, args.dirs)}
    text = table(summaries)
    for label, s in summaries.items():
        text += f"\n\n{label}: peers applying each round: {s['per_round']}"
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(f"`python -m bench.rounds {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{text}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
