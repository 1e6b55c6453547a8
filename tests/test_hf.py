"""Hugging Face models in and out: pins that catch a joiner's different copy, weights loaded as transformers loads
them, export, and generation. Every model here is a tiny random config the test saves itself: nothing downloaded."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from dht.errors import UserError
from peer.config import RunConfig
from peer.train.source import localized, pinned
from peer.train.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_hash
from tests.harness.hf import tiny_model

SMALL = dict(batch_size=2, seq_len=32, eval_batches=2)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("models") / "gpt2")


def test_the_byte_tokenizer_saved_for_transformers_gives_every_byte_its_own_id(tmp_path):
    from transformers import AutoTokenizer

    ByteTokenizer().as_transformers().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "ROMEO: Größe, 日本\n\n\tx"
    assert loaded.encode(text, add_special_tokens=False) == list(text.encode()) and len(loaded) == 256
    assert loaded.decode(list(text.encode())) == text
    assert tokenizer_hash(load_tokenizer(str(tmp_path))) == tokenizer_hash(ByteTokenizer())


def test_a_copy_of_the_run_model_elsewhere_is_accepted_and_used(gpt2, tmp_path):
    run = pinned(RunConfig(model=str(gpt2), **SMALL))
    assert run.tokenizer == str(gpt2) and run.model_config["model_type"] == "gpt2" and run.tokenizer_hash
    copy = shutil.copytree(gpt2, tmp_path / "copy")
    mine = localized(run, {"model": str(copy)})
    assert mine.model == str(copy) and mine.tokenizer == str(copy)  # the model's own tokenizer, from our copy
    assert localized(run, {}) == run  # a fresh start needs no copy of the model: its config is in the manifest


def test_a_joiner_whose_config_differs_is_told_which_keys(gpt2, tmp_path):
    run = pinned(RunConfig(model=str(gpt2), **SMALL))
    other = tiny_model(tmp_path / "deeper", n_layer=3)
    with pytest.raises(UserError, match="n_layer 3 here, 2 in the run"):
        localized(run, {"model": str(other)})


def test_a_joiner_whose_tokenizer_differs_is_refused(gpt2, tmp_path):
    run = pinned(RunConfig(model=str(gpt2), **SMALL))
    tokenizer = ByteTokenizer().as_transformers()
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    tokenizer.save_pretrained(tmp_path / "tok")
    with pytest.raises(UserError, match="differs from the run's tokenizer"):
        localized(run, {"tokenizer": str(tmp_path / "tok")})


def test_weights_are_pinned_when_the_run_starts_from_them(gpt2, tmp_path):
    run = pinned(RunConfig(model=str(gpt2), init_from_pretrained=True, **SMALL))
    assert run.weights_hash
    same_config = tiny_model(tmp_path / "reseeded", seed=1)  # same architecture, other weights
    with pytest.raises(UserError, match="weights differ"):
        localized(run, {"model": str(same_config)})
    with pytest.raises(UserError, match="lacks; pass --model DIR"):
        localized(dataclasses.replace(run, model=str(tmp_path / "gone")), {})


def test_a_config_the_tokenizer_does_not_fit_is_one_line(tmp_path):
    from peer.config import NodeConfig
    from peer.train.build import build_trainer

    small = tiny_model(tmp_path / "small", tokenizer=False, vocab_size=100)
    run = pinned(RunConfig(model=str(small), tokenizer="bytes", **SMALL))
    with pytest.raises(UserError, match="256 tokens but the model's vocabulary only 100"):
        build_trainer(run, NodeConfig(device="cpu"))


def test_generate_prints_a_continuation_of_the_prompt(gpt2, capsys):
    from peer.use import generate

    assert generate.main(["--model", str(gpt2), "--prompt", "ROMEO:", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and len(printed.encode()) > len("ROMEO:\n")


def test_generate_from_a_missing_directory_is_one_line(tmp_path, capsys):
    from peer.use import generate

    assert generate.main(["--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --model {tmp_path / 'nope'}: no such directory; pass one " \
                                              f"that python -m peer export wrote"


def test_starting_from_pretrained_weights_evaluates_as_transformers_does(gpt2):
    from transformers import AutoModelForCausalLM

    from peer.config import NodeConfig
    from peer.train.build import build_trainer

    run = localized(pinned(RunConfig(model=str(gpt2), init_from_pretrained=True, **SMALL)), {})
    corpus, trainer = build_trainer(run, NodeConfig(device="cpu"))
    batches = corpus.eval_batches(run.eval_batches, run.batch_size)
    theirs = AutoModelForCausalLM.from_pretrained(gpt2).eval()
    with torch.no_grad():
        expected = sum(theirs(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    assert trainer.evaluate(batches) == pytest.approx(expected, abs=1e-6)
