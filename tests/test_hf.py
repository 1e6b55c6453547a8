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


# ---------------------------------------------------------------- real peers


@pytest.fixture
def swarm(tmp_path):
    from tests.harness.swarm import Swarm

    swarm = Swarm(tmp_path)
    yield swarm
    swarm.close()


def held_out_loss(directory, run_args) -> float:
    """What transformers itself says of an exported model, on the run's held-out batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peer.train.data import load_corpus

    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)
    assert tokenizer.encode("ROMEO", add_special_tokens=False) == list(b"ROMEO")
    corpus = load_corpus("shakespeare", ByteTokenizer(), run_args["seq_len"], RunConfig().eval_fraction)
    batches = corpus.eval_batches(run_args["eval_batches"], run_args["batch_size"])
    with torch.no_grad():
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def assert_joiners_with_another_copy_are_refused(swarm, tmp_path, copy) -> None:
    """Joiners with another model or tokenizer than the run's are refused in one line that names the difference."""
    deeper = tiny_model(tmp_path / "deeper", n_layer=3)
    tokenizer = ByteTokenizer().as_transformers()
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    tokenizer.save_pretrained(tmp_path / "tok")
    for name, flags, says in (("c", ("--model", str(deeper)), "n_layer 3 here, 2 in the run"),
                              ("d", ("--model", str(copy), "--tokenizer", str(tmp_path / "tok")),
                               "differs from the run's tokenizer")):
        refused = swarm.peer(name, *flags, "--eval-every", "1", new_run=False)
        assert refused.wait(120) == 2
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0], refused.stderr[-2000:]


@pytest.mark.slow
def test_two_peers_train_a_hugging_face_model_bit_identically_then_export_and_sample_it(swarm, tmp_path):
    import re
    import subprocess
    import sys

    from tests.harness.swarm import assert_all_leave, assert_groups_agree, wait_until

    model = tiny_model(tmp_path / "gpt2")
    copy = shutil.copytree(model, tmp_path / "elsewhere")  # the joiner's own copy, at another path
    checkpoint = tmp_path / "ckpt"
    a = swarm.peer("a", "--model", str(model), "--eval-every", "1", "--checkpoint-dir", str(checkpoint))
    wait_until(lambda: a.reached(lambda m: len(m) >= 1), 120, "a's first round")
    b = swarm.peer("b", "--model", str(copy), "--eval-every", "1", new_run=False)
    met = lambda m: sum(r["applied"] and len(r["group"]) == 2 for r in m) >= 3  # noqa: E731
    wait_until(lambda: a.reached(met) and b.reached(met), 240, "a and b to average together 3 times")

    assert_joiners_with_another_copy_are_refused(swarm, tmp_path, copy)

    # the swarm's state now, downloaded and hash-checked as a joiner would, while a and b train on
    live = subprocess.run([sys.executable, "-m", "peer", "export", "--initial-peers", swarm.maddr, "--out",
                           str(tmp_path / "live"), "--model", str(copy)], capture_output=True, text=True, timeout=240)
    assert live.returncode == 0, live.stderr[-3000:]
    exported_hash = re.search(r"at epoch \d+ \((\w+)", live.stdout).group(1)
    assert_all_leave([a, b])
    assert any(r["state_hash"].startswith(exported_hash) for r in a.metrics + b.metrics), live.stdout
    assert assert_groups_agree([a, b]) >= 6  # every group of the two left it on one state hash

    # a's checkpoint, exported: transformers' own loss on the held-out batches is a's eval_loss at that epoch
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "peer", "export", "--checkpoint-dir", str(checkpoint), "--out",
                           str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    epoch = int(re.search(r"at epoch (\d+)", done.stdout).group(1))
    # whoever applied the step to that epoch evaluated its G (a may have adopted b's state at the last round)
    records = [r for r in a.metrics + b.metrics if r["epoch"] == epoch and r["applied"]]
    run_args = dict(seq_len=64, batch_size=4, eval_batches=2)  # the harness's FAST_RUN
    assert held_out_loss(out, run_args) == pytest.approx(records[0]["eval_loss"], abs=1e-5)
    card = (out / "README.md").read_text()
    assert f"| {epoch} |" in card and records[0]["state_hash"] in card

    for source in (("--model", str(out)), ("--checkpoint-dir", str(checkpoint))):
        sampled = subprocess.run([sys.executable, "-m", "peer", "generate", *source, "--prompt", "ROMEO:",
                                  "--max-new-tokens", "20"], capture_output=True, text=True, timeout=120)
        assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) > 8, sampled


@pytest.mark.slow
def test_an_exported_preset_checkpoint_evaluates_in_transformers_to_the_peers_eval_loss(swarm, tmp_path):
    """The presets train on peer/train/llama.py, not transformers; export writes transformers' LlamaForCausalLM, which
    must hold the same model: its held-out loss is the peer's eval_loss at the checkpoint's epoch."""
    from peer.use import export

    checkpoint = tmp_path / "ckpt"
    lone = swarm.peer("lone", "--checkpoint-dir", str(checkpoint), "--max-rounds", "2", "--eval-every", "1", join=False)
    assert lone.wait(120) == 0, lone.stderr[-3000:]
    assert export.main(["--checkpoint-dir", str(checkpoint), "--out", str(tmp_path / "out")]) == 0
    last = lone.metrics[-1]
    assert last["epoch"] == 2 and (tmp_path / "out" / "README.md").read_text().count(last["state_hash"]) == 1
    run_args = dict(seq_len=64, batch_size=4, eval_batches=2)  # the harness's FAST_RUN
    assert held_out_loss(tmp_path / "out", run_args) == pytest.approx(last["eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_a_peer_starting_from_pretrained_weights_first_evaluates_them_as_transformers_does(swarm, tmp_path):
    import re

    from tests.harness.swarm import wait_until

    model = tiny_model(tmp_path / "gpt2", seed=5)
    lone = swarm.peer("lone", "--model", str(model), "--init-from-pretrained", "--max-rounds", "1", join=False)
    assert lone.wait(120) == 0, lone.stderr[-3000:]
    wait_until(lambda: "starting weights" in lone.stderr, 5, "the starting eval line")
    first = float(re.search(r"held-out eval of the starting weights: ([\d.]+)", lone.stderr).group(1))
    assert first == pytest.approx(held_out_loss(model, dict(seq_len=64, batch_size=4, eval_batches=2)), abs=1e-6)


def test_a_hub_name_is_pinned_to_its_commit_and_loaded_from_the_hub_cache(gpt2, tmp_path):
    import os
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someorg--tiny"
    shutil.copytree(gpt2, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = ("from peer.config import RunConfig; from peer.train.source import localized, pinned; "
              "run = pinned(RunConfig(model='someorg/tiny')); print(run.revision, run.model_hash); "
              "print(localized(run, {}).tokenizer)")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")  # the hub as its cache has it
    shown = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    revision, model_hash, tokenizer = shown.stdout.split()
    assert revision == commit and model_hash == pinned(RunConfig(model=str(gpt2))).model_hash
    assert tokenizer == str(repo / "snapshots" / commit)


@pytest.mark.parametrize("kind, tokenizer", [("gpt2", None), ("qwen2", "bytes")])
def test_a_hugging_face_config_starts_from_the_same_seeded_weights_on_every_peer_and_trains(kind, tokenizer, tmp_path):
    from peer.config import NodeConfig
    from peer.train.build import build_trainer

    directory = tiny_model(tmp_path / kind, kind, tokenizer=tokenizer is None)
    run = localized(pinned(RunConfig(model=str(directory), tokenizer=tokenizer, **SMALL)), {})
    (corpus, first), (_, second) = (build_trainer(run, NodeConfig(device="cpu")) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(first.params, second.params))
    stream = corpus.stream(run.seed, "peer", 0)
    losses = [first.step(stream.next_batch(run.batch_size), lr=3e-3) for _ in range(5)]
    assert losses[-1] < losses[0]


def test_the_default_context_fits_the_model_and_a_longer_one_is_one_line(gpt2):
    from peer.train.model import build_run_model

    run = localized(pinned(RunConfig(model=str(gpt2))), {})
    assert run.seq_len == 128  # the model's n_positions, below the default 512
    with pytest.raises(UserError, match="--seq-len 500 is longer than the model's 128 positions"):
        build_run_model(dataclasses.replace(run, seq_len=500), 256)
