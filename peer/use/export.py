"""``python -m peer export``: a run's global parameters G as a Hugging Face model directory.

    python -m peer export --checkpoint-dir ckpt --out my-model                 # G at the epoch of a checkpoint
    python -m peer export --initial-peers /ip4/.../p2p/... --out my-model      # the swarm's G now, hash-checked

The directory holds ``config.json``, the weights as safetensors, the tokenizer (a byte-tokenizer run's too, as
``transformers`` loads it) and a model card naming the run, epoch, tokens, state hash and held-out loss.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from dht.cli import Parser, add_arguments, from_args
from dht.errors import UserError
from peer.ops.report import fail


@dataclass
class Snapshot:
    """G of one epoch of a run, and what the model card says about it."""

    run_id: str
    manifest_hash: str
    run: Any  # RunConfig, localized: this machine's tokenizer copy
    params: Any  # the flat fp32 G
    epoch: int
    tokens_total: int
    state_hash: str
    eval_batches: Optional[list] = None  # the run's held-out batches, when the exporter has built them already


def from_checkpoint(directory: str, flags: Dict[str, Any]) -> Snapshot:
    from peer.config import RunConfig
    from peer.ops.checkpoint import CheckpointPayload
    from peer.outer.state import state_hash

    payload = CheckpointPayload.load(directory)
    if payload is None:
        raise UserError(f"--checkpoint-dir {directory} holds no checkpoint (state.pt); pass a peer's --checkpoint-dir")
    run = RunConfig.from_settings(dict(payload.manifest_settings or payload.manifest_record["settings"]))
    return Snapshot(payload.run_id, payload.manifest_hash, with_tokenizer(run, flags, directory), payload.params,
                    int(payload.epoch), int(payload.tokens_total),
                    state_hash(payload.params, payload.momentum, int(payload.epoch)))


def with_tokenizer(run, flags: Dict[str, Any], checkpoint_dir: Optional[str] = None):
    """``run`` with a tokenizer this machine has: as ``localized`` finds it, else the copy a peer keeps beside its
    checkpoint. The model needs no copy: its architecture is in the manifest, and G is its weights."""
    from peer.train.source import localized

    architecture = dataclasses.replace(run, init_from_pretrained=False)
    try:
        return dataclasses.replace(localized(architecture, flags), init_from_pretrained=run.init_from_pretrained)
    except UserError:
        kept = os.path.join(checkpoint_dir or "", "tokenizer")
        if checkpoint_dir is None or "tokenizer" in flags or not os.path.isdir(kept):
            raise
        return with_tokenizer(run, dict(flags, tokenizer=kept))


def from_swarm(node, net, flags: Dict[str, Any], timeout: float = 120.0) -> Snapshot:
    """Join as a client, download the swarm's state as a joiner does (hash-checked), leave."""
    from peer.config import SyncConfig
    from peer.hooks import Hooks
    from peer.round.build import build_parts

    parts = build_parts(flags, node, SyncConfig(), dataclasses.replace(net, client_mode=True), None, Hooks())
    try:
        download(parts, node.run_id, timeout)
        parts.announcer.announce(60.0, status="left")  # nobody waits for us in a group
        return Snapshot(node.run_id, parts.manifest.hash, with_tokenizer(parts.run, flags), parts.state.params.clone(),
                        parts.state.epoch, parts.state.tokens_total, parts.state.hash(), parts.eval_batches)
    finally:
        parts.close()


def download(parts, run_id: str, timeout: float) -> None:
    """Adopt the swarm's best state, trying again until ``timeout``: a holder refuses a download of the state it
    just left for the next epoch, and records read a moment before name that one."""
    deadline = time.monotonic() + timeout
    while True:
        if parts.catchup.catch_up(timeout=max(1.0, deadline - time.monotonic())).adopted:
            return
        ours = parts.state.hash()  # at epoch 0, a fresh run's start: the state we built is the swarm's
        if any(r.state_hash == ours for r in parts.cache.records.values() if r.peer_id != parts.peer_id):
            return
        if time.monotonic() >= deadline:
            raise UserError(f"no peer of run '{run_id}' served its state within {timeout:.0f} s; check that the "
                            f"run's peers are up (python -m peer status --initial-peers ...)")
        time.sleep(1.0)  # the next round's records


def write(snapshot: Snapshot, out: str, evaluate: bool = True) -> Optional[float]:
    """The snapshot as a Hugging Face model directory in ``out``; returns the held-out loss the card states."""
    from peer.train.flat import FlatLayout
    from peer.train.model import transformers_model
    from peer.train.tokenizer import load_tokenizer

    run = snapshot.run
    tokenizer = load_tokenizer(run.tokenizer)
    model = transformers_model(run, tokenizer.vocab_size)  # a preset too: its peers' Llama has the same layout
    params = list(model.parameters())
    layout = FlatLayout(params)
    if layout.numel != snapshot.params.numel():
        raise UserError(f"the state has {snapshot.params.numel()} parameters, the run's model {layout.numel}")
    layout.scatter(snapshot.params, params)
    model.config.use_cache = True  # for generation; the loss is the same
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.as_transformers().save_pretrained(out)
    loss = held_out_loss(model, run, tokenizer, snapshot.eval_batches) if evaluate else None
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(snapshot, loss, out))
    return loss


def held_out_loss(model, run, tokenizer, batches: Optional[list] = None) -> Optional[float]:
    """The mean loss on the run's held-out batches, as a peer's ``eval_loss`` computes it; None if this machine
    lacks the run's dataset. ``batches``: those batches, if built already (a download from the swarm built them)."""
    import torch

    from peer.train.build import run_corpus

    if batches is None:
        try:
            batches = run_corpus(run, tokenizer).eval_batches(run.eval_batches, run.batch_size)
        except UserError as e:
            print(f"no held-out loss in the model card: {e}", flush=True)
            return None
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=batch, labels=batch).loss.item() for batch in batches]
    return sum(losses) / len(losses) if losses else None


def model_card(snapshot: Snapshot, loss: Optional[float], out: str) -> str:
    run = snapshot.run
    origin = "a fresh initialisation" if not run.init_from_pretrained else f"the weights of {run.model}"
    loss_text = f"{loss:.6f}" if loss is not None else "not measured"
    return f"""---
library_name: transformers
tags: [decoupled-diloco, diloco]
---
# {snapshot.run_id}, epoch {snapshot.epoch}

The global parameters of decoupled-diloco run `{snapshot.run_id}` (manifest `{snapshot.manifest_hash}`), trained
by its peers from {origin}.

| epoch | tokens | state hash | held-out loss |
|---|---|---|---|
| {snapshot.epoch} | {snapshot.tokens_total:,} | `{snapshot.state_hash}` | {loss_text} |

Model `{run.model}`, tokenizer `{run.tokenizer}`, dataset `{run.dataset}`, context {run.seq_len} tokens. The
held-out loss is the mean over the run's first {run.eval_batches} held-out batches, as its peers report
`eval_loss`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{out}")
tokenizer = AutoTokenizer.from_pretrained("{out}")
```
"""


def parse_args(argv: Optional[Sequence[str]]):
    from dht.node import DHTConfig

    parser = Parser(prog="python -m peer export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the model to")
    parser.add_argument("--checkpoint-dir", help="a peer's checkpoint directory: export its epoch")
    parser.add_argument("--run-id", default="diloco", help="with --initial-peers: the run (default: diloco)")
    parser.add_argument("--run-token", default=os.environ.get("DILOCO_RUN_TOKEN"), help="a private run's secret")
    parser.add_argument("--run-key", help="with --initial-peers: only the run of the creator with this key")
    parser.add_argument("--tokenizer", help="this machine's copy of the run's Hugging Face tokenizer")
    parser.add_argument("--model", help="this machine's copy of the run's Hugging Face model (for its tokenizer)")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out loss in the model card")
    add_arguments(parser, DHTConfig, "network (with --initial-peers: export the swarm's state)")
    args = parser.parse_args(argv)
    if (args.checkpoint_dir is None) == (not getattr(args, "initial_peers", None)):
        parser.error("pass either --checkpoint-dir or --initial-peers")
    return args, from_args(DHTConfig, args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args, net = parse_args(argv)
        from peer.train.model import quiet_transformers

        quiet_transformers()
        flags = {k: getattr(args, k) for k in ("model", "tokenizer") if getattr(args, k)}
        if args.checkpoint_dir is not None:
            snapshot = from_checkpoint(args.checkpoint_dir, flags)
        else:
            from peer.config import NodeConfig

            node = NodeConfig(run_id=args.run_id, run_token=args.run_token, run_key=args.run_key, quiet=True)
            for noisy in ("peer", "hivemind"):  # a peer's lines ("training on ours for now") say nothing here
                logging.getLogger(noisy).setLevel(logging.ERROR)
            print(f"downloading the state of run '{args.run_id}' from the swarm (hash-checked)", file=sys.stderr,
                  flush=True)
            snapshot = from_swarm(node, net, flags)
        loss = write(snapshot, args.out, evaluate=not args.no_eval)
    except (UserError, ValueError) as e:
        return fail(str(e))
    held_out = f", held-out loss {loss:.6f}" if loss is not None else ""
    print(f"exported run '{snapshot.run_id}' at epoch {snapshot.epoch} ({snapshot.state_hash[:8]}{held_out}) to "
          f"{args.out}", flush=True)
    return 0
