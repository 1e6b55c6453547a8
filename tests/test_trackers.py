"""Trackers grouped by run: W&B (offline, as ``WANDB_MODE=offline`` runs it without an account) puts a run's peers
in one group, each its own W&B run with the epoch as the step."""

from __future__ import annotations

import pytest

from tests.harness.swarm import Swarm, wait_until
from tests.harness.wandb_log import run_and_steps

pytestmark = pytest.mark.slow


def test_wandb_puts_a_runs_peers_in_one_group_with_the_epoch_as_the_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    # the peers inherit it: offline, its files under the test's directory, no banner
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    swarm = Swarm(tmp_path)
    try:
        peers = [swarm.peer(f"p{i}", "--wandb", "swarm", "--max-rounds", "3") for i in range(2)]
        # W&B writes its transaction log through when the run finishes: a peer's exit
        wait_until(lambda: all(not peer.alive() for peer in peers), 240, "both peers to finish 3 rounds and exit")
    finally:
        swarm.close()
    for peer in peers:
        assert peer.popen.returncode == 0, peer.stderr[-2000:]
        peer_id = peer.metrics[0]["peer_id"]
        logs = list(tmp_path.glob(f"wandb/offline-run-*-diloco-{peer_id}/run-diloco-{peer_id}.wandb"))
        assert len(logs) == 1, sorted(tmp_path.glob("wandb/*"))
        run, history = run_and_steps(logs[0])
        assert (run.run_group, run.run_id, run.project) == ("diloco", f"diloco-{peer_id}", "swarm")
        epochs = {record["epoch"]: record["loss"] for record in peer.metrics}  # a repeated epoch: its last round
        steps = {step: items["loss"] for step, items in history}
        assert steps == pytest.approx(epochs, rel=1e-6), (steps, epochs)
