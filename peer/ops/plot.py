"""``python -m peer plot``: training curves from peers' ``--metrics-file`` JSON lines, one line per peer.

    python -m peer plot runs/*.jsonl -o loss.png

Four panels: training loss (and held-out eval loss, as dots) against the tokens the peer trained and
against wall time, the group size of each round, and the bytes each round's all-reduce sent. A peer
that was restarted with the same metrics file stays one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dht.cli import Parser
from peer.ops.report import fail

NEEDED = ("epoch", "time", "loss", "tokens", "group_size", "bytes_sent")


def read_runs(paths: Sequence[Path]) -> Dict[str, List[dict]]:
    """{label: records} for every file; a file that is missing or holds no metrics is a one-line error."""
    runs = {}
    for path in paths:
        if not path.is_file():
            raise ValueError(f"{path}: no such file; pass the files peers wrote with --metrics-file")
        records, lines = [], path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    continue  # a line being written as we read
                raise ValueError(f"{path}:{number} is not a JSON line; is this a --metrics-file?") from None
            missing = [k for k in NEEDED if k not in record]
            if missing:
                raise ValueError(f"{path}:{number} lacks {', '.join(missing)}; is this a --metrics-file?")
            records.append(record)
        if not records:
            raise ValueError(f"{path} holds no rounds yet; plot it once its peer has finished a round")
        label = path.stem if len(paths) > 1 or not records[0].get("peer_id") else records[0]["peer_id"][-8:]
        runs[label] = records
    return runs


def plot(runs: Dict[str, List[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["time"] for records in runs.values() for r in records)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (by_tokens, by_time), (groups, sent) = axes
    for label, records in runs.items():
        tokens, total = [], 0
        for r in records:
            total += r["tokens"]
            tokens.append(total)
        minutes = [(r["time"] - t0) / 60 for r in records]
        loss = [r["loss"] for r in records]
        line, = by_tokens.plot(tokens, loss, label=label)
        by_time.plot(minutes, loss, color=line.get_color(), label=label)
        evals = [(t, m, r["eval_loss"]) for t, m, r in zip(tokens, minutes, records) if r.get("eval_loss") is not None]
        if evals:
            by_tokens.plot([e[0] for e in evals], [e[2] for e in evals], "o", color=line.get_color(), ms=4)
            by_time.plot([e[1] for e in evals], [e[2] for e in evals], "o", color=line.get_color(), ms=4)
        epochs = [r["epoch"] for r in records]
        groups.step(epochs, [r["group_size"] for r in records], where="post", color=line.get_color(), label=label)
        sent.plot(epochs, [r["bytes_sent"] / 1e6 for r in records], ".-", color=line.get_color(), label=label)
    by_tokens.set(xlabel="tokens trained by the peer", ylabel="loss (dots: held-out eval)", title="loss vs tokens")
    by_time.set(xlabel="wall time (minutes)", ylabel="loss (dots: held-out eval)", title="loss vs time")
    groups.set(xlabel="epoch", ylabel="peers", title="group size per round")
    groups.yaxis.get_major_locator().set_params(integer=True)
    sent.set(xlabel="epoch", ylabel="MB", title="bytes sent per round")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    by_tokens.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = Parser(prog="python -m peer plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="--metrics-file outputs, one per peer")
    parser.add_argument("-o", "--output", type=Path, default=Path("loss.png"), help="PNG to write (default loss.png)")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.metrics)
        plot(runs, args.output)
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(f"wrote {args.output} ({len(runs)} peer{'s' * (len(runs) != 1)}, "
          f"{sum(len(r) for r in runs.values())} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
