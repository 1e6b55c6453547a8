"""Does one bad peer hurt the others? 3 honest peers alone, then with a 4th that sends garbage every round.

    python -m bench.robustness --rounds 20 --repeats 3 --out bench/results/robustness.md

Three swarms in turn on loopback (tests' fast settings: tiny model, 4 x 64-token batches, H = 5):
``clean`` (3 honest peers), ``nan`` (the same 3 plus one sending NaN, ``--byzantine nan``) and
``scale`` (plus one sending 1000 x its real pseudo-gradient). The honest peers use the same seeds and
peer ids (their identities are fixed), so they see the same data in every swarm. Reported: the honest
peers' held-out eval loss of the global state at the last common evaluated epoch, its gap to ``clean``,
whether the honest peers' state hashes agreed in every round, and what the reducers said about the bad
peer. With ``--repeats N`` the three swarms run N times, interleaved (clean, nan, scale, clean, ...), and
the table gives each swarm's mean and spread: wall-clock rounds make every run end a little differently,
so one run per swarm cannot tell a 2% gap from noise.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List

from tests.harness.swarm import Swarm, assert_groups_agree, by_epoch

SWARMS = {"clean": None, "nan": "nan", "scale": "scale:1000"}


def run_swarm(name: str, byzantine, rounds: int, root: Path, keys: Path) -> dict:
    log_dir = root / name
    log_dir.mkdir(parents=True)
    swarm = Swarm(log_dir)
    try:
        run = ("--eval-every", "5", "--eval-batches", "8")
        honest = [swarm.peer(f"p{i}", "--max-rounds", str(rounds), *run, "--identity-path", str(keys / f"p{i}.key"))
                  for i in range(3)]
        if byzantine:
            swarm.peer("bad", "--max-rounds", str(rounds + 5), *run, byzantine=byzantine)
        for peer in honest:
            assert peer.wait(60 * rounds) == 0, peer.stderr[-3000:]
    finally:
        swarm.close()
    agreed = assert_groups_agree(honest) > 0
    table = by_epoch(honest)
    evals = {epoch: statistics.mean(r["eval_loss"] for r in records.values())
             for epoch, records in table.items() if all(r["eval_loss"] is not None for r in records.values())
             and len(records) == 3}
    split = [epoch for epoch, records in table.items() if len({r["state_hash"] for r in records.values()}) > 1]
    offences = [r["offences"] for peer in honest for r in peer.metrics if r.get("offences")]
    banned = any("banned peer" in peer.stderr for peer in honest)
    group_sizes = sorted({r["group_size"] for peer in honest for r in peer.metrics})
    return dict(name=name, byzantine=byzantine or "-", evals=evals, agreed=agreed and not split, split=split,
                offence_rounds=len(offences), banned=banned, group_sizes=group_sizes)


def report(runs: List[List[dict]]) -> str:
    """``runs``: per repeat, the three swarms' results."""
    common = set.intersection(*(set(r["evals"]) for results in runs for r in results))
    epoch = max(common)
    names = [r["name"] for r in runs[0]]
    losses = {name: [next(r for r in results if r["name"] == name)["evals"][epoch] for results in runs]
              for name in names}
    clean = statistics.mean(losses["clean"])
    spread = lambda values: statistics.stdev(values) if len(values) > 1 else 0.0  # noqa: E731
    lines = [f"Held-out eval loss of the honest peers' global state at epoch {epoch} (mean of the 3 honest peers; "
             f"{len(runs)} run(s) per swarm: mean ± standard deviation over runs):", "",
             "| swarm | 4th peer sends | eval loss per run | mean ± sd | gap of means to clean | honest hashes agree "
             "every round | rounds with offences reported | bad peer banned |", "|---|---|---|---|---|---|---|---|"]
    for name in names:
        results = [next(r for r in rs if r["name"] == name) for rs in runs]
        values = losses[name]
        mean = statistics.mean(values)
        splits = [r["split"] for r in results if not r["agreed"]]
        lines.append(f"| {name} | {results[0]['byzantine']} | {', '.join(f'{v:.4f}' for v in values)} | "
                     f"{mean:.4f} ± {spread(values):.4f} | {100 * (mean - clean) / clean:+.2f}% | "
                     f"{'yes, in every run' if not splits else 'no: ' + str(splits)} | "
                     f"{', '.join(str(r['offence_rounds']) for r in results)} | "
                     f"{', '.join('yes' if r['banned'] else 'no' for r in results)} |")
    lines += ["", f"Run-to-run noise of the clean swarm: sd {spread(losses['clean']):.4f} "
                  f"({100 * spread(losses['clean']) / clean:.2f}% of its mean)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each swarm, interleaved")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="robustness_"))
    keys = root / "keys"
    keys.mkdir()
    print(f"logs: {root}", flush=True)
    runs = []
    for repeat in range(args.repeats):
        results = []
        for name, byzantine in SWARMS.items():
            results.append(run_swarm(name, byzantine, args.rounds, root / str(repeat), keys))
            print(f"run {repeat} {name}: evals {results[-1]['evals']}", flush=True)
        runs.append(results)
    text = report(runs)
    print(text)
    if args.out:
        command = shlex.join(["python", "-m", "bench.robustness", *argv])
        args.out.write_text(f"# One bad peer among three honest ones\n\nCommand:\n\n    {command}\n\nMeasured "
                            f"{datetime.date.today().isoformat()} on loopback, logs in {root}.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
