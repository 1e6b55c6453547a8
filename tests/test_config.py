"""Configs validate themselves and the CLI is derived from them."""

import argparse
import dataclasses
import math

import pytest

from dht.cli import add_arguments, explicit_values, from_args
from dht.manifest import RunManifest
from dht.node import DHTConfig
from peer.__main__ import parse_args
from peer.config import NodeConfig, RunConfig, SyncConfig
from peer.outer.schedule import portable_cos


def test_required_flags_exist_with_help():
    parser = argparse.ArgumentParser()
    for cls in (RunConfig, NodeConfig, DHTConfig, SyncConfig):
        add_arguments(parser, cls)
    text = parser.format_help()
    for flag in ("--initial-peers", "--run-id", "--model", "--dataset", "--inner-steps", "--round-seconds",
                 "--max-rounds", "--batch-size", "--lr", "--outer-lr", "--outer-momentum", "--compression",
                 "--checkpoint-dir", "--metrics-file", "--host-maddrs", "--device", "--seed"):
        assert flag in text
    assert "outer Nesterov learning rate (DiLoCo: 0.7) (default: 0.7)" in " ".join(text.split())


def test_only_explicit_flags_are_reported():
    run_flags, node, sync, net = parse_args(["--model", "small", "--outer-lr", "0.5", "--max-rounds", "3",
                                             "--initial-peers", "/ip4/1.2.3.4/tcp/5/p2p/" + "Qm" + "a" * 44])
    assert run_flags == {"model": "small", "outer_lr": 0.5}
    assert node.max_rounds == 3 and sync == SyncConfig()
    assert net.initial_peers == ("/ip4/1.2.3.4/tcp/5/p2p/Qm" + "a" * 44,)


@pytest.mark.parametrize("field, value, message", [
    ("outer_momentum", 1.0, "outer_momentum must be in [0, 1), got 1.0"),
    ("inner_steps", 0, "inner_steps must be positive, got 0"),
    ("lr", 2.0, "lr must be in (0, 1), got 2.0"),
    ("grace_seconds", -1.0, "grace_seconds must be >= 0, got -1.0"),
])
def test_bad_values_name_the_field_and_value(field, value, message):
    with pytest.raises(ValueError) as error:
        RunConfig(**{field: value})
    assert str(error.value) == message


def test_resolved_fills_preset_defaults_and_keeps_explicit_ones():
    resolved = RunConfig(model="tiny", lr=0.002).resolved()
    assert resolved.lr == 0.002 and resolved.tokenizer == "bytes" and resolved.inner_steps == 50
    assert RunConfig(model="150m").resolved().tokenizer == "gpt2"


def test_the_outer_lr_decays_with_the_inner_lr_only_when_asked():
    run = RunConfig(outer_lr=0.4, lr_decay_steps=1000, min_lr_ratio=0.1, outer_warmup=0)
    assert [run.outer_lr_at(step) for step in (0, 500, 1000, 5000)] == [0.4] * 4
    decaying = dataclasses.replace(run, outer_lr_decay=True)
    assert [round(decaying.outer_lr_at(step), 6) for step in (0, 500, 1000, 5000)] == [0.4, 0.22, 0.04, 0.04]
    assert decaying.outer_lr_at(500) / decaying.outer_lr == pytest.approx(run.lr_factor(500))  # the inner's curve
    assert max(abs(portable_cos(x / 100) - math.cos(x / 100)) for x in range(315)) < 1e-15


def test_the_outer_warmup_blends_plain_averaging_into_nesterov_by_the_epoch():
    run = RunConfig(inner_steps=100, outer_lr=0.7, outer_momentum=0.9, outer_warmup=4)
    steps = [epoch * 100 for epoch in (0, 1, 2, 4, 9)]
    assert [round(run.outer_lr_at(s), 6) for s in steps] == [1.0, 0.925, 0.85, 0.7, 0.7]  # lr 1, momentum 0 first
    assert [round(run.outer_momentum_at(s), 6) for s in steps] == [0.0, 0.225, 0.45, 0.9, 0.9]
    assert run.outer_lr_at(450) == run.outer_lr_at(400) == run.outer_lr  # within an epoch, and exactly after
    off = dataclasses.replace(run, outer_warmup=0)
    assert (off.outer_lr_at(0), off.outer_momentum_at(0)) == (0.7, 0.9)


def test_the_outer_warmup_by_default_follows_h_and_the_manifest_pins_it():
    """A small H warms up over more outer steps (the sweeps' best: 32 at H = 10, 16 at 50, 8 at 100); the resolved
    config, which the manifest carries, holds the number, so every peer of the run blends alike."""
    assert [RunConfig(inner_steps=h).resolved().outer_warmup for h in (10, 50, 100, 500)] == [32, 14, 10, 4]
    assert RunConfig(inner_steps=10, outer_warmup=0).resolved().outer_warmup == 0  # given: kept, 0 included
    run = RunConfig(inner_steps=10, outer_lr=0.7, outer_momentum=0.9)
    assert run.outer_lr_at(16 * 10) == RunConfig(inner_steps=10, outer_warmup=32).outer_lr_at(16 * 10) == 0.85
    assert RunConfig.from_settings(run.to_settings()).outer_warmup == 32


def test_the_outer_momentum_by_default_follows_h_and_the_manifest_pins_it():
    """A small H's pseudo-gradients are small and many, and Nesterov's memory of 0.9 overshoots them (the sweeps' best:
    0.5 at H = 2 and 3, 0.6 at 5, 0.8 at 7, 0.9 at 10): the default is 1 - 10 / H^2 between 0.5 and 0.9, and the
    resolved config, which the manifest carries, holds it, so every peer of the run steps alike."""
    defaults = [RunConfig(inner_steps=h).resolved().outer_momentum for h in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 500)]
    assert defaults == [0.5, 0.5, 0.5, 0.5, 0.6, 0.72, 0.8, 0.84, 0.88, 0.9, 0.9, 0.9]
    assert RunConfig(model="tiny").resolved().outer_momentum == 0.9  # the presets' H: DiLoCo's
    assert RunConfig(inner_steps=5, outer_momentum=0.9).resolved().outer_momentum == 0.9  # given: kept
    assert RunConfig(inner_steps=5, outer_momentum=0.0).resolved().outer_momentum == 0.0  # plain averaging included
    run = RunConfig(inner_steps=5, outer_warmup=2)
    assert [run.outer_momentum_at(epoch * 5) for epoch in (0, 1, 2)] == [0.0, 0.3, 0.6]  # the warm-up blends into it
    assert RunConfig.from_settings(run.to_settings()).outer_momentum == 0.6


def test_manifest_hash_is_stable_and_covers_every_setting():
    settings = RunConfig().to_settings()
    assert RunManifest("r", settings).hash == RunManifest("r", dict(settings)).hash
    assert RunManifest("r", settings).hash != RunManifest("r", RunConfig(seed=1).to_settings()).hash
    assert RunManifest("r", settings).hash != RunManifest("other", settings).hash
    assert RunConfig.from_settings(settings) == RunConfig().resolved()
    with pytest.raises(ValueError, match="does not know"):
        RunConfig.from_settings(dict(settings, warp_drive=True))


def test_node_config_checks_the_run_id():
    with pytest.raises(ValueError, match="run_id"):
        NodeConfig(run_id="a.b")


def test_from_args_builds_dht_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser, DHTConfig)
    config = from_args(DHTConfig, parser.parse_args(["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--client-mode"]))
    assert config.host_maddrs == ("/ip4/127.0.0.1/tcp/0",) and config.client_mode
    assert explicit_values(parser.parse_args([]), DHTConfig) == {}


def test_readme_documents_every_flag():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for cls in (RunConfig, NodeConfig, DHTConfig, SyncConfig):
        for field in dataclasses.fields(cls):
            if field.metadata.get("cli", True):  # a field kept out of the parser is no flag
                assert f"`--{field.name.replace('_', '-')}`" in readme, f"README lacks --{field.name}"


def test_help_lists_the_subcommands(capsys):
    from peer.__main__ import COMMANDS

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert set(COMMANDS) == {"status", "plot", "export", "generate"}
    assert "Commands: status, plot, export, generate (python -m peer COMMAND --help)" in out
    assert "--config CONFIG" in out


def test_the_allreduce_ceiling_leaves_a_large_model_on_a_thin_uplink_time_for_its_first_round():
    sync = SyncConfig()
    assert sync.allreduce_ceiling(2e6) == 60.0  # a small model: the flag's ceiling
    assert sync.allreduce_ceiling(300e6) == pytest.approx(720.0)  # 300 MB three times over at 10 Mbit/s
    assert SyncConfig(allreduce_timeout=900.0).allreduce_ceiling(300e6) == 900.0
