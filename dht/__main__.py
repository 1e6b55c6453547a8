"""A bootstrap node that does not train: it keeps the swarm's DHT reachable at a stable address.

    python -m dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path bootstrap.key

prints the multiaddrs to pass to peers as ``--initial-peers``, one per line, then serves until
Ctrl+C or SIGTERM. With ``--identity-path`` the peer id, and so the address, survives restarts.
``--maddr-file`` also writes them to a file (atomically), for scripts and containers that start
peers once the bootstrap node is up.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional, Sequence, Tuple

from dht.addresses import private_only_hint
from dht.cli import Parser, add_arguments, from_args
from dht.errors import UserError
from dht.node import DHTConfig, start_dht, visible_maddrs
from dht.processes import fork_children, stop_process


def parse_args(argv: Optional[Sequence[str]] = None) -> Tuple[DHTConfig, Optional[str]]:
    parser = Parser(prog="python -m dht", description=__doc__.split("\n\n")[0])
    add_arguments(parser, DHTConfig)
    parser.add_argument("--maddr-file", help="also write the multiaddrs to this file once the node is up")
    args = parser.parse_args(argv)
    try:
        return from_args(DHTConfig, args), args.maddr_file
    except ValueError as e:
        raise UserError(str(e)) from None


def write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    except OSError as e:
        raise UserError(f"--maddr-file {path}: cannot write it ({e.strerror})") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    fork_children()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = None
    try:
        config, maddr_file = parse_args(argv)
        dht = start_dht(config)
        # hivemind ignores SIGINT in the parent while it forks; take it back so Ctrl+C stops us cleanly
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        maddrs = visible_maddrs(dht)
        for maddr in maddrs:
            print(maddr, flush=True)
        if maddr_file:
            write_atomically(maddr_file, "".join(f"{maddr}\n" for maddr in maddrs))
        print(f"bootstrap node {dht.peer_id} is up; pass one of the addresses above as --initial-peers",
              file=sys.stderr, flush=True)
        hint = private_only_hint(maddrs)  # announced public addresses are among them
        if hint:
            print(f"warning: {hint}", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            lost = dht.link_lost()
            if lost and not stop.is_set():  # (systemd stops the daemon with us)
                raise UserError(lost)
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dht is not None:
            stop_process(dht)


if __name__ == "__main__":
    sys.exit(main())
