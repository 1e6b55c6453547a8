"""``python -m peer status``: the swarm's health from its own DHT records, without joining the training.

    python -m peer status --initial-peers /ip4/.../p2p/...            # one table, then exit
    python -m peer status --initial-peers ... --watch                 # refresh every 5 s until Ctrl+C
    python -m peer status --initial-peers ... --json                  # the same data for machines
    python -m peer status --initial-peers ... --serve 8080            # the same in a browser, refreshing itself

There is no server to ask: every peer publishes a record (epoch, state hash, loss, speed, bytes per
round, schedule) under the run's key, and this command reads them through a client-mode DHT node,
which accepts no connections and never appears in the swarm's records itself.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from dht.addresses import parse_maddrs
from dht.cli import Parser
from dht.errors import UserError
from peer.ops.report import fail, human_bytes

WATCH_SECONDS = 5.0
LOOKUP_TIMEOUT = 10.0


def parse_args(argv: Optional[Sequence[str]]):
    parser = Parser(prog="python -m peer status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of any peers of the swarm")
    parser.add_argument("--run-id", default="diloco", help="the run to show (default: diloco)")
    parser.add_argument("--run-token", default=os.environ.get("DILOCO_RUN_TOKEN"),
                        help="a private run's shared secret (default: $DILOCO_RUN_TOKEN)")
    parser.add_argument("--watch", nargs="?", type=float, const=WATCH_SECONDS, default=None, metavar="SECONDS",
                        help=f"refresh every SECONDS (default {WATCH_SECONDS:g}) until Ctrl+C")
    parser.add_argument("--json", action="store_true", help="print one JSON object (per refresh with --watch)")
    parser.add_argument("--serve", type=int, metavar="PORT", help="serve the swarm's dashboard on this port "
                        "(0: any free one) until Ctrl+C; the page refreshes itself from the DHT")
    parser.add_argument("--serve-host", default="127.0.0.1", help="the address --serve listens on (default: "
                        "127.0.0.1; 0.0.0.0 for every interface)")
    parser.add_argument("--startup-timeout", type=float, default=30.0, help="seconds to reach the initial peers")
    args = parser.parse_args(argv)
    parse_maddrs(args.initial_peers, flag="--initial-peers", need_peer_id=True)
    if args.watch is not None and args.watch <= 0:
        parser.error("--watch takes a positive number of seconds")
    if args.serve is not None and not 0 <= args.serve < 65536:
        parser.error(f"--serve takes a port number (0-65535, 0: any free one), got {args.serve}")
    return args


def snapshot(dht, run_id: str, namespace: str) -> Dict[str, Any]:
    """The run's manifest and its peers' records, as plain data (what ``--json`` prints)."""
    from hivemind.utils import get_dht_time

    from dht.manifest import fetch_manifest
    from dht.records import fetch_records

    manifest = fetch_manifest(dht, namespace)
    records = fetch_records(dht, namespace, timeout=LOOKUP_TIMEOUT) or {}
    now = get_dht_time()
    peers = []
    for record in sorted(records.values(), key=lambda r: (-r.epoch, r.peer_id)):
        row = dataclasses.asdict(record)
        row["last_seen_seconds"] = max(0.0, now - record.updated_at)
        row["stale"] = record.silent()  # its heartbeats stopped: dead, frozen or cut off
        peers.append(row)
    return dict(run_id=run_id, time=time.time(), manifest=None if manifest is None else manifest.to_record(),
                peers=peers, forks=forks(peers))


def forks(peers: List[Dict[str, Any]]) -> Dict[int, List[str]]:
    """Epochs at which live peers hold different states: {epoch: [hashes]}. Peers at different epochs
    are behind or ahead, not forked."""
    by_epoch = collections.defaultdict(set)
    for row in peers:
        if row["status"] != "left":
            by_epoch[row["epoch"]].add(row["state_hash"])
    return {epoch: sorted(hashes) for epoch, hashes in by_epoch.items() if len(hashes) > 1}


def summary(data: Dict[str, Any], initial_peers: Sequence[str]) -> str:
    live = [p for p in data["peers"] if p["status"] != "left"]
    if not data["peers"]:
        where = "the run has no manifest either: check --run-id (and --run-token)" if data["manifest"] is None else \
            "its manifest is there, so its peers left (records expire within a minute or two)"
        return f"no live peers of run '{data['run_id']}' through {initial_peers[0]}: {where}"
    epochs = sorted({p["epoch"] for p in live})
    left = len(data["peers"]) - len(live)
    fork_text = "; ".join(f"fork at epoch {e}: {len(h)} states" for e, h in sorted(data["forks"].items()))
    behind = f" (some behind, at {', '.join(map(str, epochs[:-1]))})" if len(epochs) > 1 else ""
    return (f"run '{data['run_id']}': {len(live)} live peer{'s' * (len(live) != 1)}{f', {left} left' if left else ''}"
            f" | epoch {epochs[-1] if epochs else '-'}{behind} | {fork_text or 'no forks'}")


def render(data: Dict[str, Any], initial_peers: Sequence[str]):
    """A rich renderable: the manifest line, the peers table and a summary."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    manifest = data["manifest"]
    if manifest is not None:
        settings = manifest["settings"]
        parts.append(Text(f"run '{data['run_id']}' manifest {manifest['hash']} ({manifest['version']}): "
                          + ", ".join(f"{k}={settings[k]}" for k in ("model", "dataset", "inner_steps", "compression",
                                                                        "batch_size", "seq_len") if k in settings)))
    if data["peers"]:
        table = Table(show_edge=False, header_style="bold")
        for column in ("peer", "status", "epoch", "loss", "tokens/s", "last seen", "reach", "sent/round", "state"):
            table.add_column(column, justify="right" if column in ("epoch", "loss", "tokens/s", "last seen",
                                                                    "sent/round") else "left")
        forked = {h for hashes in data["forks"].values() for h in hashes}
        for p in data["peers"]:
            state = p["state_hash"][:8] + (" fork" if p["state_hash"] in forked else "")
            table.add_row(
                p["peer_id"][-10:], p["status"], str(p["epoch"]),
                "-" if p["loss"] is None else f"{p['loss']:.3f}", f"{p['tokens_per_second']:,.0f}",
                f"{p['last_seen_seconds']:.0f}s ago", "client" if p["client_mode"] else p.get("reach") or "server",
                human_bytes(p["bytes_per_round"]) if p["bytes_per_round"] else "-",
                Text(state, style="red" if p["state_hash"] in forked else ""),
            )
        parts.append(table)
    parts.append(Text(summary(data, initial_peers)))
    return Group(*parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except (UserError, ValueError) as e:
        return fail(str(e))
    from rich.console import Console
    from rich.live import Live

    from dht.manifest import run_namespace
    from dht.node import DHTConfig, start_dht
    from dht.processes import stop_process
    from dht.validation import run_validators

    namespace = run_namespace(args.run_id, args.run_token)
    dht = None
    try:
        dht = start_dht(DHTConfig(initial_peers=tuple(args.initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                                  client_mode=True, startup_timeout=args.startup_timeout),
                        run_validators(namespace))
        console = Console(highlight=False, soft_wrap=True)
        if not console.is_terminal:
            console.width = 200  # piped to a file or a test: never truncate a column
        if args.serve is not None:
            return _serve(lambda: snapshot(dht, args.run_id, namespace), args.serve, args.serve_host)
        data = snapshot(dht, args.run_id, namespace)
        if args.watch is None:
            if args.json:
                print(json.dumps(data), flush=True)
            else:
                console.print(render(data, args.initial_peers))
            return 0 if data["peers"] else 1
        if args.json:
            while True:
                print(json.dumps(data), flush=True)
                time.sleep(args.watch)
                data = snapshot(dht, args.run_id, namespace)
        with Live(render(data, args.initial_peers), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.watch)
                live.update(render(snapshot(dht, args.run_id, namespace), args.initial_peers), refresh=True)
    except UserError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 0
    finally:
        if dht is not None:
            stop_process(dht)


def _serve(take_snapshot, port: int, host: str) -> int:
    from peer.ops.dashboard import Dashboard

    dashboard = Dashboard(take_snapshot, port, host).start()
    print(f"serving the swarm's dashboard at {dashboard.url} (Ctrl+C to stop)", flush=True)
    try:
        dashboard.stopped.wait()
    finally:
        dashboard.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
