"""Build the inner trainer of a run on this node's device: the same on a plain peer and on every rank of an island."""

from __future__ import annotations

import signal
from typing import Optional

import torch

from peer.config import NodeConfig, RunConfig
from peer.train.data import load_corpus
from peer.train.inner import InnerTrainer
from peer.train.island import Island, island_batches
from peer.train.model import build_run_model
from peer.train.tokenizer import load_tokenizer


def run_corpus(run: RunConfig, tokenizer):
    """The run's dataset, tokenized, with its held-out split: the same on every peer and in ``peer export``."""
    return load_corpus(run.dataset, tokenizer, run.seq_len, run.eval_fraction, run.dataset_config,
                       text_field=run.text_field)


def build_trainer(run: RunConfig, node: NodeConfig, island: Optional[Island] = None):
    """The corpus and the inner trainer of ``run`` on this node's device (each rank of an island calls it)."""
    tokenizer = load_tokenizer(run.tokenizer)  # run is localized: this node's copy (peer/train/source.py)
    corpus = run_corpus(run, tokenizer)
    if island is not None:
        device = island.device
    elif node.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(node.device)
    model = build_run_model(run, tokenizer.vocab_size)
    trainer = InnerTrainer(model, run, device, node.micro_batch, node.min_step_seconds, island=island,
                           compile=node.compile)
    return corpus, trainer


def run_follower(island: Island, node: NodeConfig) -> int:
    """Ranks 1..n-1 of an island: the run's settings from rank 0, the same trainer, then rank 0's commands."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the island stops, and tells the others
        signal.signal(sig, signal.SIG_IGN)
    if node.threads:
        torch.set_num_threads(node.threads)
    setup = island.share(None)
    if setup is None:
        return 0  # rank 0 stopped before training (it said why)
    run = RunConfig.from_settings(setup["settings"])
    corpus, trainer = build_trainer(run, node, island)
    stream = corpus.stream(run.seed, setup["shard_key"], island.share(None))
    island.follow(trainer, island_batches(stream, run.batch_size, island))
    return 0
