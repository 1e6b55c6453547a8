"""A decoupled-DiLoCo training node.

    python -m peer                                      # start a new run alone on the bundled default
    python -m peer --initial-peers /ip4/.../p2p/...     # join a run: its settings come from the swarm
    python -m peer status --initial-peers ...           # the swarm's peers, epochs, losses and forks
    python -m peer plot METRICS.jsonl... -o loss.png    # loss, group size and bytes per round, per peer
    python -m peer export --checkpoint-dir DIR --out M  # the run's model as a Hugging Face model directory
    python -m peer generate --model M --prompt "..."    # sample a continuation from it
    torchrun --nproc-per-node 8 -m peer ...             # one peer of 8 GPUs: data-parallel inside (an island)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from typing import Optional, Sequence

from dht.cli import Parser, add_arguments, explicit_values
from dht.errors import UserError
from dht.node import DHTConfig
from dht.processes import fork_children
from peer import config_file
from peer.config import NodeConfig, RunConfig, SyncConfig
from peer.ops.orphans import quiet_orphaned_tasks
from peer.ops.report import fail

COMMANDS = dict(status="peer.ops.status", plot="peer.ops.plot", export="peer.use.export",
                generate="peer.use.generate")


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = Parser(
        prog="python -m peer", description=__doc__.split("\n\n")[0],
        epilog="Run settings are shared by every peer of a run (the manifest); a joiner needs none of them. "
               "Commands: " + ", ".join(COMMANDS) + " (python -m peer COMMAND --help).",
    )
    add_arguments(parser, RunConfig, "run settings (shared through the run manifest)")
    add_arguments(parser, NodeConfig, "this node")
    add_arguments(parser, DHTConfig, "network")
    add_arguments(parser, SyncConfig, "sync deadlines")
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    from_file = config_file.load(path) if path else {}
    given = {cls: {**from_file.get(cls, {}), **explicit_values(args, cls)}
             for cls in (RunConfig, NodeConfig, SyncConfig, DHTConfig)}
    run_flags = given[RunConfig]  # a value from the file counts as given: the manifest check sees it
    RunConfig(**run_flags)  # validate now: a bad value is a one-line error before anything starts
    if "model" in run_flags:
        from peer.train.source import require_model_spec

        require_model_spec(run_flags["model"])
    return run_flags, NodeConfig(**given[NodeConfig]), SyncConfig(**given[SyncConfig]), DHTConfig(**given[DHTConfig])


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    # hivemind logs every failed all-reduce with a traceback; our own lines say what happened
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.CRITICAL)
    if verbose:
        logging.getLogger("peer").setLevel(logging.DEBUG)
    else:
        quiet_orphaned_tasks()


def main(argv: Optional[Sequence[str]] = None, hooks=None) -> int:
    """``hooks``: a test harness's (``peer/hooks.py``); a user's peer runs with the no-op ones."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fork_children()  # the commands start hivemind's processes too (status a DHT; export a DHT and an averager)
    if argv and argv[0] in COMMANDS:
        command = importlib.import_module(COMMANDS[argv[0]])
        return command.main(argv[1:])
    try:
        run_flags, node, sync, net = parse_args(argv)
    except (UserError, ValueError) as e:
        return fail(str(e))
    setup_logging(node.verbose)
    from peer.hooks import Hooks  # these import torch and hivemind: after the flags are known to be fine
    from peer.round.build import build_parts
    from peer.round.node import Peer
    from peer.train.build import run_follower
    from peer.train.island import Island
    from peer.train.model import quiet_transformers

    if not node.verbose:
        quiet_transformers()

    with contextlib.ExitStack() as closing:  # on every path, in reverse: the peer leaves, its parts stop
        try:
            island = Island.from_env(node.device)  # under torchrun: this rank's place in its island
            if island is not None:
                closing.callback(island.close)
                if not island.leader:
                    return run_follower(island, node)
            parts = build_parts(run_flags, node, sync, net, island, hooks or Hooks())
            closing.callback(parts.close)
            peer = Peer(parts, node, sync, island, hooks)
            closing.callback(peer.close)
            peer.join()
            return peer.run_rounds()
        except (UserError, ValueError) as e:
            return fail(str(e))

if __name__ == "__main__":
    sys.exit(main())
