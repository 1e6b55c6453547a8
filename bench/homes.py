"""A swarm of mostly homes: who reduces, with the homes in client mode against the homes relayed.

    sudo python -m bench.homes --homes 3 --rounds 8 [--out bench/results/homes.md]

Network namespaces (docker/netns.py): one public peer, ``--homes`` peers each behind its own NAT router with no port
forwarded, and the bootstrap node on the host, which relays. The same swarm runs twice, side by side in one
command: with the homes on the default path (nobody can dial them, so they go on in client mode) and with
``--if-unreachable relay`` (full members through relay circuits). From the rounds that held every peer in one
group, it reports the fraction of the vector each peer reduced (the metrics' ``reduced``) and the bytes it moved
a round (state downloads served to homes that fell behind included).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from docker.netns import TestNetwork
from tests.harness.swarm import Swarm, by_epoch, wait_until

FLAGS = ("--round-seconds", "4", "--compression", "int4-huffman")


def whole_rounds(peers) -> List[Dict[str, dict]]:
    """The rounds in which every peer applied one state in one group holding all of them."""
    ids = {p.metrics[0]["peer_id"] for p in peers if p.metrics}
    return [records for _, records in sorted(by_epoch(peers).items())
            if len(records) == len(peers) == len(ids) and len({r["state_hash"] for r in records.values()}) == 1
            and all(ids <= set(r["group"]) for r in records.values())]


def run(mode: str, homes: int, rounds: int, log_dir: Path) -> dict:
    home_flags = ("--if-unreachable", "relay") if mode == "relayed" else ()
    with TestNetwork(homes + 1, behind_nat=tuple(range(1, homes + 1)), routable=True) as network:
        (log_dir / mode).mkdir()
        swarm = Swarm(log_dir / mode, network)
        try:
            public = swarm.peer("public", *FLAGS, namespace=0)
            wait_until(lambda: public.metrics, 120, "the public peer's first round")
            peers = [public] + [swarm.peer(f"home{i}", *FLAGS, *home_flags, namespace=i) for i in range(1, homes + 1)]
            wait_until(lambda: len(whole_rounds(peers)) >= rounds, 600, f"{rounds} rounds with every peer")
            for peer in peers:
                peer.signal(signal.SIGTERM)
            for peer in peers:
                peer.wait(120)
        finally:
            swarm.close()
    table = whole_rounds(peers)[-rounds:]
    mean = lambda name, field: statistics.mean(records[name][field] for records in table)  # noqa: E731
    homes = [name for name in table[0] if name != public.name]  # by_epoch keys records by peer name
    return dict(mode=mode, rounds=len(table), public_reduced=mean(public.name, "reduced"),
                home_reduced=statistics.mean(mean(name, "reduced") for name in homes),
                public_bytes=(mean(public.name, "bytes_received"), mean(public.name, "bytes_sent")),
                home_bytes=(statistics.mean(mean(name, "bytes_received") for name in homes),
                            statistics.mean(mean(name, "bytes_sent") for name in homes)),
                reach=sorted({line.split("reach: ")[1].split()[0] for p in peers[1:] for line in p.stderr.splitlines()
                              if "reach: " in line}))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--homes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="homes_"))
    results = [run(mode, args.homes, args.rounds, log_dir) for mode in ("client", "relayed")]
    lines = [f"`python -m bench.homes --homes {args.homes} --rounds {args.rounds}`: 1 public peer, {args.homes} "
             f"homes behind NAT, micro preset, int4-huffman; means over the last {args.rounds} rounds that held "
             f"every peer in one group on one state.", "",
             "| homes | their reach | rounds | public peer reduces | each home reduces | public peer: received / "
             "sent a round | a home: received / sent a round |", "|---|---|---|---|---|---|---|"]
    for r in results:
        (pr, ps), (hr, hs) = r["public_bytes"], r["home_bytes"]
        lines.append(f"| {r['mode']} | {', '.join(r['reach'])} | {r['rounds']} | {100 * r['public_reduced']:.0f}% | "
                     f"{100 * r['home_reduced']:.0f}% | {pr / 1e3:,.1f} kB / {ps / 1e3:,.1f} kB | "
                     f"{hr / 1e3:,.1f} kB / {hs / 1e3:,.1f} kB |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
