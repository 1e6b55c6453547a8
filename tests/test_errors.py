"""A user's mistake ends in one line that says what is wrong and what to do, and a non-zero exit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.harness.swarm import MADDR, ROOT, Proc, Swarm, peer_command, wait_until


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, f"expected one error line, got:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("command", ["peer", "dht"])
def test_malformed_multiaddr(command):
    result = run_cli(sys.executable, "-m", command, "--initial-peers", "/ip4/10.0.0/tcp/31337")
    assert_one_line_error(result, "malformed multiaddr '/ip4/10.0.0/tcp/31337'", "expected something like")


@pytest.mark.parametrize("command", [("peer", "--compression", "no-such-codec"), ("peer", "status", "--bogus"),
                                     ("dht", "--port", "1")])
def test_a_bad_flag_is_one_line_naming_the_choices_and_help(command):
    result = run_cli(sys.executable, "-m", *command)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    line = assert_one_line_error(result, "--help")
    if "--compression" in command:
        assert "'no-such-codec'" in line and "'fp16'" in line, line


@pytest.mark.parametrize("command", ["peer", "dht"])
def test_native_windows_is_refused_in_one_line_naming_wsl2_and_docker(command):
    pretend = f"import sys, runpy; sys.platform = 'win32'; sys.argv = ['{command}']; runpy.run_module('{command}')"
    result = run_cli(sys.executable, "-c", pretend)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert_one_line_error(result, "native Windows is not supported", "WSL2", "docker")


@pytest.mark.parametrize("command", ["peer", "dht"])
def test_a_start_shows_nothing_of_torchs_deprecation_of_what_hivemind_scripts_at_import(command):
    """torch 2.15 (what pip installs today) warns at each import of hivemind that torch.jit.script, which hivemind uses,
    is deprecated: a FutureWarning, two lines on a user's terminal at every start. torch 2.13 says it where only -W
    shows it. Made an error here, it would end the program on either torch."""
    result = run_cli(sys.executable, "-W", "error:`torch.jit.script`", "-m", command, "--help")
    assert result.returncode == 0 and "torch.jit" not in result.stderr, result.stderr[-2000:]


def test_multiaddr_without_peer_id():
    result = run_cli(*peer_command("--initial-peers", "/ip4/127.0.0.1/tcp/31337"))
    assert_one_line_error(result, "lacks the /p2p/<peer id> part")


def test_bad_flag_value_names_the_field():
    result = run_cli(*peer_command("--outer-momentum", "1.5"))
    assert_one_line_error(result, "outer_momentum", "1.5")


@pytest.mark.slow
def test_unreachable_initial_peers():
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmavmNZtc76v2j5NMfWuotX5jhWW9xa8EA4DDvtNdEEPwU"
    result = run_cli(*peer_command("--initial-peers", dead, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"))
    assert_one_line_error(result, "could not reach any initial peer", dead)


@pytest.mark.slow
def test_a_joiner_naming_a_run_nobody_trains_or_a_conflicting_model_is_refused(tmp_path):
    """A typo in --run-id never starts a run of its own: without --new-run, a name the swarm does not know is one
    line naming the runs it does. The creator (given --new-run) said it created the run."""
    swarm = Swarm(tmp_path)
    try:
        creator = swarm.peer("creator")
        creator.wait_rounds(1, timeout=180)
        assert "created run 'diloco'" in creator.stderr
        joiner = ("--initial-peers", swarm.maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
        result = run_cli(*peer_command(*joiner, "--model", "small"))
        assert_one_line_error(result, "--model small conflicts with run 'diloco'", "model=micro", "drop the flag")
        result = run_cli(*peer_command(*joiner, "--run-id", "dilocco"))
        assert_one_line_error(result, "no run named 'dilocco' is reachable through these peers (runs seen: diloco)",
                              "pass --new-run to start it")
    finally:
        swarm.close()


@pytest.mark.slow
def test_listen_address_not_on_this_machine():
    result = run_cli(sys.executable, "-m", "dht", "--host-maddrs", "/ip4/10.255.255.1/tcp/0")
    assert_one_line_error(result, "cannot listen on /ip4/10.255.255.1/tcp/0: that address is not on this machine")


@pytest.mark.parametrize("victim", ["p2p daemon", "DHT process"])
def test_a_bootstrap_node_whose_p2p_daemon_or_dht_process_dies_says_so_and_exits(tmp_path, victim):
    """Its DHT could no longer answer anyone, while the node looked up. (A peer: tests/test_faults.py.)"""
    from tests.harness.swarm import p2p_daemons, parent_pid

    node = Proc([sys.executable, "-m", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], tmp_path, "bootstrap")
    try:
        wait_until(lambda: MADDR.findall(node.stdout), 60, "the bootstrap node")
        daemons = p2p_daemons(node.popen.pid)
        assert len(daemons) == 1, daemons
        # (the daemon's parent is the DHT's process, and the daemon dies with it)
        os.kill(daemons[0] if victim == "p2p daemon" else parent_pid(daemons[0]), signal.SIGKILL)
        assert node.wait(30) == 2, node.stderr[-3000:]
        result = subprocess.CompletedProcess(node.args, 2, node.stdout, node.stderr)
        assert_one_line_error(result, f"this node's {victim} died", "start it again")
    finally:
        node.kill_group()


@pytest.mark.slow
def test_identity_used_by_another_live_peer(tmp_path):
    key = tmp_path / "bootstrap.key"
    swarm = Swarm(tmp_path)
    try:
        first = swarm.track(Proc([sys.executable, "-m", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                  "--identity-path", str(key), "--initial-peers", swarm.maddr], tmp_path, "first"))
        wait_until(lambda: MADDR.findall(first.stdout), 60, "the first node")
        result = run_cli(sys.executable, "-m", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--identity-path",
                         str(key), "--initial-peers", swarm.maddr)
        assert_one_line_error(result, f"identity {key} is used by another live peer", "its own --identity-path")
    finally:
        swarm.close()


@pytest.mark.slow
def test_state_download_from_a_frozen_holder_gives_up_and_trains_on(tmp_path):
    swarm = Swarm(tmp_path)
    try:
        holder = swarm.peer("holder")
        holder.wait_rounds(2, timeout=180)
        os.killpg(holder.popen.pid, signal.SIGSTOP)  # its record still says it holds epoch >= 2
        joiner = swarm.peer("joiner")
        message = "could not download the swarm's state from any holder; training on ours for now"
        wait_until(lambda: message in joiner.stderr or not joiner.alive(), 120, "the joiner to give up the download")
        assert message in joiner.stderr, joiner.stderr[-3000:]
        joiner.wait_rounds(1, timeout=120)  # and it trains on
    finally:
        swarm.close()


@pytest.mark.slow
def test_tracker_that_is_not_installed_is_named(tmp_path):
    # as on a machine without wandb: its import fails (a None in sys.modules makes it raise ImportError)
    absent = ("import sys, runpy; sys.modules['wandb'] = None; "
              "sys.argv = ['peer', '--wandb', 'my-project', '--host-maddrs', '/ip4/127.0.0.1/tcp/0']; "
              "runpy.run_module('peer', run_name='__main__')")
    result = run_cli(sys.executable, "-c", absent)
    assert_one_line_error(result, "--wandb needs the wandb package: pip install wandb")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["peer", "dht"])
@pytest.mark.parametrize("skew", ["-30s", "+30s"])
def test_a_clock_far_from_the_swarms_is_one_line_saying_by_how_much_and_how_to_set_it(tmp_path, command, skew):
    """hivemind's DHT refuses a node whose clock is more than 3 s from its initial peer's (a VM or WSL2 after a
    sleep, a machine without NTP); the joiner said so with a traceback. libfaketime sets this process's clock off."""
    if shutil.which("faketime") is None:
        pytest.skip("faketime (Debian's package) is not installed: .ci/run installs it")
    swarm = Swarm(tmp_path)
    try:
        joiner = ("--initial-peers", swarm.maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
        argv = peer_command(*joiner) if command == "peer" else [sys.executable, "-m", "dht", *joiner]
        result = run_cli("faketime", "-f", skew, *argv)
        line = assert_one_line_error(result, "the swarm's DHT accepts at most 3 s", "timedatectl set-ntp true")
        assert re.search(rf"clock is (29|30|31)\.\d s {'behind' if skew.startswith('-') else 'ahead of'} ", line), line
    finally:
        swarm.close()
