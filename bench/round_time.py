"""One round of a local swarm, split into compute and sync, with the bytes each peer moves.

    python -m bench.round_time --peers 3 --rounds 4 -- --threads 1

starts a bootstrap node and N real ``python -m peer`` processes on loopback (the embedded default:
tiny model, bundled Shakespeare, unless flags after ``--`` say otherwise), lets them run the given
number of rounds, and prints a markdown table from their metrics files. Rounds where not every peer
was in the group are reported but left out of the means.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tests.harness.swarm import MADDR, PeerProc, Proc, wait_until


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("peer_args", nargs="*", help="extra flags for every peer (after --)")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="round_time_"))
    bootstrap = Proc([sys.executable, "-m", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], log_dir, "bootstrap")
    procs = [bootstrap]
    try:
        maddr = wait_until(lambda: (MADDR.findall(bootstrap.stdout) or [None])[0], 60, "the bootstrap node")
        common = ["--initial-peers", maddr, "--new-run", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--quiet",
                  "--max-rounds", str(args.rounds), *args.peer_args]
        peers = [PeerProc(common, log_dir, f"peer{i}") for i in range(args.peers)]
        procs += peers
        for peer in peers:
            if peer.wait(3600) != 0:
                raise SystemExit(f"{peer.name} failed:\n{peer.stderr[-2000:]}")
        rows = [r for peer in peers for r in peer.metrics]
        full = [r for r in rows if r["group_size"] == args.peers]
        print("| peers | rounds in full groups | round wall s | compute s | sync s | sent MB/peer/round "
              "| received MB/peer/round | tokens/s/peer |")
        print("|---|---|---|---|---|---|---|---|")
        mean = lambda key: statistics.mean(r[key] for r in full)  # noqa: E731
        print(f"| {args.peers} | {len(full) // args.peers} of {args.rounds} | "
              f"{mean('compute_seconds') + mean('sync_seconds'):.1f} | {mean('compute_seconds'):.1f} | "
              f"{mean('sync_seconds'):.2f} | {mean('bytes_sent') / 1e6:.2f} | {mean('bytes_received') / 1e6:.2f} | "
              f"{mean('tokens_per_second'):,.0f} |")
        print(f"\nmetrics files: {log_dir}")
        return 0
    finally:
        for proc in procs:
            proc.kill_group()


if __name__ == "__main__":
    sys.exit(main())
