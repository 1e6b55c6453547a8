"""``--config run.toml``: every flag from a TOML file, type-checked with one-line errors; typed flags win; a value
from the file counts as given, so the manifest check refuses it as it would the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dht.node import DHTConfig
from peer import config_file
from peer.__main__ import parse_args
from peer.config import RunConfig
from tests.harness.swarm import FAST_NODE, ROOT, Swarm, peer_command, wait_until


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_every_bundled_config_loads_and_builds_its_configs():
    assert set(config_file.bundled()) == {"tiny", "home-150m", "private-servers"}
    for name in config_file.bundled():
        for cls, values in config_file.load(name).items():
            cls(**values)
    home = config_file.load("home-150m")
    assert home[RunConfig] == {"model": "150m", "compression": "int4-huffman"}
    assert home[DHTConfig] == {"if_unreachable": "relay"}


def test_flags_typed_on_the_command_line_win_and_the_files_values_count_as_given(tmp_path):
    path = write(tmp_path, '[run]\nmodel = "micro"\ninner-steps = 7\nlr = 0.003\n[node]\nmax_rounds = 3\n'
                           '[network]\nhost_maddrs = ["/ip4/127.0.0.1/tcp/0"]\n[sync]\nretries = 1\n')
    run_flags, node, sync, net = parse_args(["--config", path, "--inner-steps", "9", "--max-rounds", "4"])
    assert run_flags == {"model": "micro", "inner_steps": 9, "lr": 0.003}  # all three are explicit for the manifest
    assert (node.max_rounds, node.config, sync.retries, net.host_maddrs) == (4, path, 1, ("/ip4/127.0.0.1/tcp/0",))
    assert config_file.from_file(path, "lr", 0.003) and not config_file.from_file(path, "inner_steps", 9)


@pytest.mark.parametrize("text, message", [
    ('[run]\nseqlen = 64\n', "[run] has no setting 'seqlen' (did you mean seq_len?)"),
    ('[run]\nseq_len = "512"\n', "[run] seq_len must be an integer, got '512'"),
    ('[run]\nlr = true\n', "[run] lr must be a number, got True"),
    ('[run]\ncompression = "zip"\n', "[run] compression must be one of none, fp16, int8, int4, int4-huffman"),
    ('[run]\nlr = 5\n', "[run] lr must be in (0, 1), got 5.0"),
    ('[network]\ninitial_peers = "/ip4/1.2.3.4/tcp/1"\n', "[network] initial_peers must be a list of strings"),
    ('[network]\ninitial_peers = ["/ip4/1.2.3"]\n', "[network] --initial-peers: malformed multiaddr '/ip4/1.2.3'"),
    ('[model]\nlr = 0.1\n', "unknown section [model]; the sections are [run], [node], [network], [sync]"),
    ('[node]\nconfig = "other.toml"\n', "a config file cannot name another"),
    ('[run\n', "not valid TOML"),
])
def test_a_bad_file_is_one_line_naming_the_file_the_section_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        config_file.load(path)
    assert str(e.value).startswith(f"--config {path}") and message in str(e.value), str(e.value)


def test_a_missing_file_names_the_bundled_ones():
    with pytest.raises(ValueError, match=r"--config nope: no such file, and no bundled config of that name "
                                         r"\(bundled: home-150m, private-servers, tiny\)"):
        config_file.load("nope")


def test_a_strangers_manifest_of_the_wrong_types_is_named_not_a_traceback():
    settings = RunConfig(model="micro").to_settings()
    with pytest.raises(ValueError, match=r"the run manifest's seq_len must be an integer, got '512'"):
        RunConfig.from_settings({**settings, "seq_len": "512"})
    with pytest.raises(ValueError, match=r"the run manifest's error_feedback must be true or false, got 1"):
        RunConfig.from_settings({**settings, "error_feedback": 1})
    assert RunConfig.from_settings({**settings, "outer_lr": 1}).outer_lr == 1.0  # an integer is a number


def test_the_peer_refuses_a_bad_file_in_one_line(tmp_path):
    path = write(tmp_path, '[run]\nseq_len = "512"\n')
    result = subprocess.run(peer_command("--config", path), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stderr.strip().splitlines() == [
        f"error: --config {path}: [run] seq_len must be an integer, got '512'"]


@pytest.mark.slow
def test_a_run_from_a_bundled_file_with_one_flag_overridden_pins_the_override_and_refuses_a_joiners_conflict(
        tmp_path):
    swarm = Swarm(tmp_path, defaults=FAST_NODE)
    try:
        creator = swarm.peer("creator", "--config", "tiny", "--inner-steps", "7")
        wait_until(lambda: "created run 'diloco'" in creator.stderr or not creator.alive(), 120, "the run's creation")
        status = subprocess.run([sys.executable, "-m", "peer", "status", "--initial-peers", swarm.maddr, "--json"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        settings = json.loads(status.stdout)["manifest"]["settings"]
        assert (settings["model"], settings["inner_steps"], settings["compression"]) == ("tiny", 7, "int4-huffman")
        joiner = write(tmp_path, "[run]\ninner_steps = 9\n")
        result = subprocess.run(peer_command("--config", joiner, "--initial-peers", swarm.maddr, "--host-maddrs",
                                             "/ip4/127.0.0.1/tcp/0", *FAST_NODE),
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and "Traceback" not in result.stderr and errors == [
            f"error: inner_steps = 9 in {joiner} conflicts with run 'diloco', which uses inner_steps=7; drop it "
            f"from the file to join it, or pass another --run-id to start a new run"], result.stderr
    finally:
        swarm.close()
