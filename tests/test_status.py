"""``python -m peer status`` and ``python -m peer plot`` against a live 3-peer swarm and its metrics files.

The swarm is a private run (``--run-token``) and runs with ``--overlap`` (each round's sync in the
background of the next round), so the same processes also show that a stranger without the token cannot
join, and that overlapped rounds keep every group bit-identical: one swarm, not three, for CI time.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness.swarm import ROOT, Proc, Swarm, assert_groups_agree, by_epoch, wait_until

pytestmark = pytest.mark.slow
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    swarm = Swarm(tmp_path_factory.mktemp("status"))
    try:
        board = swarm.log_dir / "tensorboard"
        # rounds of 15 steps (~3 s): overlap hides a sync behind the next round's compute, which needs the round
        # to outlast the sync; with the tests' usual 5 steps (~1 s) a sync (~1-5 s) spans several rounds, and a
        # peer that missed one group once stayed out of step for the rest of the run
        peers = [swarm.peer(f"p{i}", "--overlap", "--run-token", TOKEN, "--inner-steps", "15",
                            *(["--tensorboard", str(board)] if i == 0 else [])) for i in range(3)]
        for peer in peers:
            peer.wait_rounds(2, timeout=180)
        yield swarm, peers
    finally:
        swarm.close()


def run_command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def agreeing(line: str, ids: set) -> bool:
    """A --json snapshot in which the three peers are all listed at one epoch with one state hash."""
    data = json.loads(line)
    peers = {p["peer_id"]: p for p in data["peers"]}
    return (set(peers) == ids and len({p["epoch"] for p in peers.values()}) == 1
            and len({p["state_hash"] for p in peers.values()}) == 1 and not data["forks"])


def test_status_lists_every_live_peer_with_agreeing_epochs_and_hashes(live, tmp_path):
    swarm, peers = live
    ids = {peer.metrics[0]["peer_id"] for peer in peers}
    # --watch --json prints a snapshot per refresh; one taken while the group applies its outer step can
    # catch a peer that has not republished yet, so wait for a snapshot in which all three agree
    watcher = Proc([sys.executable, "-m", "peer", "status", "--initial-peers", swarm.maddr, "--json",
                    "--watch", "1", "--run-token", TOKEN], tmp_path, "watch")
    try:
        line = wait_until(lambda: next((line for line in watcher.stdout.splitlines() if line.endswith("}")
                                        and agreeing(line, ids)), None), 90, "a status snapshot listing all 3 peers")
    finally:
        watcher.kill_group()
    data = json.loads(line)
    assert data["manifest"]["settings"]["model"] == "micro" and data["run_id"] == "diloco"
    for row in data["peers"]:
        assert row["status"] in ("training", "syncing") and row["tokens_per_second"] > 0
        assert row["last_seen_seconds"] < 60 and row["client_mode"] is False and row["bytes_per_round"] > 0

    table = run_command("status", "--initial-peers", swarm.maddr, "--run-token", TOKEN)
    assert table.returncode == 0, table.stderr
    for peer_id in ids:
        assert peer_id[-10:] in table.stdout, table.stdout
    assert "run 'diloco': 3 live peers" in table.stdout and "micro" in table.stdout, table.stdout


def test_status_of_an_empty_swarm_says_so_in_one_line(live):
    swarm, _ = live
    result = run_command("status", "--initial-peers", swarm.maddr, "--run-id", "nobody")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 1
    assert lines == [f"no live peers of run 'nobody' through {swarm.maddr}: the run has no manifest either: "
                     f"check --run-id (and --run-token)"], result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_plot_writes_a_png_from_real_metrics(live, tmp_path):
    _, peers = live
    out = tmp_path / "loss.png"
    result = run_command("plot", *(str(peer.metrics_path) for peer in peers), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} (3 peers, "), result.stdout
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] >= 600 and image.shape[1] >= 1000
    assert image[..., :3].std() > 0.05, "the plot is blank"

    bad = tmp_path / "notes.jsonl"
    bad.write_text("not json\n{}\n")
    result = run_command("plot", str(bad), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {bad}:1 is not a JSON line; is this a --metrics-file?"), result.stderr


def test_tensorboard_gets_every_round_of_the_metrics_file(live):
    swarm, peers = live
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = peers[0].metrics
    # one directory per peer under the run's
    events = EventAccumulator(str(swarm.log_dir / "tensorboard" / "diloco" / records[0]["peer_id"]))
    events.Reload()
    logged = [(event.step, event.value) for event in events.Scalars("peer/loss")]
    assert len(logged) >= len(records)  # one point per round, at its epoch (which repeats when a round applied none)
    for record in records:
        assert any(step == record["epoch"] and value == pytest.approx(record["loss"], rel=1e-6)
                   for step, value in logged), (logged, record)
    assert {"peer/sync_seconds", "peer/bytes_sent", "peer/group_size"} <= set(events.Tags()["scalars"])


def test_overlapped_rounds_keep_states_identical_and_learn(live):
    """--overlap: each round's sync runs while the next round trains (which starts from this peer's eager outer
    step); groups still end bit-identical, and the loss falls."""
    _, peers = live
    for peer in peers:
        peer.wait_rounds(8, timeout=240)
    # the invariant: in every round, the members of every group hold one state hash
    assert assert_groups_agree(peers) >= 5 * 2
    assert len(by_epoch(peers)) >= 8
    # and the three keep meeting: each group agrees when the round in progress ends (the median of the members'
    # plans), so a peer's drift is undone every round. (Before that, a peer that missed one group could stay
    # out of step for the rest of the run: seen, 25 rounds of catching up without contributing.)
    full = [epoch for epoch, records in by_epoch(peers).items()
            if len(records) == 3 and all(r["group_size"] == 3 for r in records.values())]
    assert len(full) >= 5, {peer.name: [(r["epoch"], r["group_size"]) for r in peer.metrics] for peer in peers}
    for peer in peers:
        records = peer.metrics
        assert all(r["overlap"] for r in records)
        assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
        evals = [r["eval_loss"] for r in records if r["eval_loss"] is not None]
        assert evals and evals[-1] < 4.0, evals  # G itself learned (untrained: ln 256 = 5.5)


def test_a_stranger_without_the_token_cannot_join_the_private_run(live):
    """Same bootstrap, same run id, no token: the stranger finds no run, starts its own, and trains alone; the
    private peers never see it in a group."""
    swarm, peers = live
    stranger = swarm.peer("stranger")
    stranger.wait_rounds(2, timeout=120)
    stranger.kill_group()
    stranger_id = stranger.metrics[0]["peer_id"]
    assert all(r["group_size"] == 1 for r in stranger.metrics)
    for peer in peers:
        assert all(stranger_id not in r["group"] for r in peer.metrics)
    private = run_command("status", "--initial-peers", swarm.maddr, "--run-token", "wrong", "--json")
    assert private.returncode == 1 and json.loads(private.stdout)["peers"] == []  # a wrong token sees nothing
