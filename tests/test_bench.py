"""The benchmarks' own parts that a wrong result would hide in: the data-parallel baseline's restart, the scale
simulation, the head-to-head's comparison, the checkpoint bench's stand-in peer, the convergence sweep's goal, the codec
table's baselines."""

import sys

import pytest

from peer.presets import PRESETS
from tests.harness.swarm import Proc, read_metrics, wait_until

ROUND_STEPS, BATCH = 2, 2


def test_the_data_parallel_baseline_resumes_from_its_checkpoint(tmp_path):
    """bench.goodput charges data-parallel training for restarting from its last checkpoint at every failure;
    a baseline that never wrote one (its directory did not exist) restarted from step 0 instead, so a killed
    job's work since the start was lost, not just since its last checkpoint. A relaunched rank must resume:
    its first record's tokens_total continues from the checkpointed one."""
    metrics = tmp_path / "rank0.jsonl"
    args = [sys.executable, "-m", "bench.sync_worker", "--rank", "0", "--world-size", "1", "--port", "0",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(metrics),
            "--inner-steps", str(ROUND_STEPS), "--batch-size", str(BATCH)]
    first = Proc(args, tmp_path, "launch1")
    try:
        wait_until(lambda: len(read_metrics(metrics)) >= 2 or not first.alive(), 120, "two checkpointed rounds")
    finally:
        first.kill_group()
    assert (tmp_path / "ckpt" / "state.pt").exists(), first.stderr[-3000:]
    saved = read_metrics(metrics)
    second = Proc(args, tmp_path, "launch2")
    try:
        wait_until(lambda: len(read_metrics(metrics)) > len(saved) or not second.alive(), 120, "a resumed round")
    finally:
        second.kill_group()
    resumed = read_metrics(metrics)[len(saved)]
    per_round = ROUND_STEPS * BATCH * PRESETS["tiny"].seq_len  # the worker's default model
    assert resumed["tokens_total"] >= saved[-1]["tokens_total"] + per_round, (resumed, saved, second.stderr[-3000:])


# a simulated peer whose thread crashes fails the test
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_scale_simulation_runs_the_products_rounds_to_one_state_per_epoch_across_groups():
    """bench.scale runs the product's Synchronizer on a simulated network: 24 peers in groups of 8 under churn
    merge across 3 groups, and every epoch holds one state. (The figures are bench/results/scale.md's.)"""
    from bench import scale

    # with overlap, the default: before its syncs joined a window before their meeting, 88% of them applied
    args = scale.parse_args(["--minutes", "40", "--churn", "0.05", "--inner-steps", "50"])
    result = scale.simulate(24, 8, args, seed=1)
    summary = scale.summarize(result, 24)
    rows = result["rows"]
    assert summary["epochs"] >= 4 and summary["forked"] == 0 and summary["states"] == 1, summary
    assert {r["groups"] for r in rows if r["applied"]} >= {3}
    assert summary["applied_share"] >= 0.95, summary["failed"]
    assert summary["loss"] < rows[0]["loss"]  # the global state moves towards the shared target


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_scale_simulation_overlaps_each_sync_with_the_next_round_as_the_peers_do():
    """With overlap (the peers' default), a simulated peer trains the next round while its sync runs, and counts as
    sync only its wait at the round's end: the same swarm makes more rounds in the same time than with blocking
    syncs, and still holds one state per epoch."""
    from bench import scale

    flags = ["--minutes", "10", "--churn", "0.05", "--inner-steps", "30", "--speed-spread", "1", "--home-share", "0",
             "--overhead", "5"]
    runs = {overlap: scale.simulate(16, 0, scale.parse_args(flags + [overlap]), seed=1)
            for overlap in ("--overlap", "--no-overlap")}
    summaries = {overlap: scale.summarize(result, 16) for overlap, result in runs.items()}
    overlapped, blocking = summaries["--overlap"], summaries["--no-overlap"]
    assert overlapped["states"] == blocking["states"] == 1 and overlapped["applied_share"] >= 0.9, summaries
    assert overlapped["epochs"] > blocking["epochs"], summaries
    rows = runs["--overlap"]["rows"]
    assert sum(r["sync"] for r in rows) < 0.1 * sum(r["sync_wall"] for r in rows)  # the syncs ran while training
    assert all(r["sync"] == r["sync_wall"] for r in runs["--no-overlap"]["rows"])


def test_the_head_to_head_compares_what_each_system_held_at_the_same_wall_time():
    """bench.head_to_head: a system's loss at time t is its last evaluation by then (never a later one), hivemind's
    is the mean of its workers' replicas, and the peers' count only rounds they applied."""
    from bench.head_to_head import Curve, alone, evaluations

    peers = [[dict(epoch=2, time=110.0, applied=True, eval_loss=3.0, tokens_total=100),
              dict(epoch=4, time=130.0, applied=False, eval_loss=9.0, tokens_total=200)],
             [dict(epoch=2, time=111.0, applied=True, eval_loss=3.0, tokens_total=100)]]
    assert evaluations("diloco", peers, launched=100.0) == [(10.0, 100, 3.0)]
    workers = [[dict(epoch=2, time=120.0, eval_loss=3.0, tokens_total=80)],
               [dict(epoch=2, time=125.0, eval_loss=4.0, tokens_total=80)]]
    assert evaluations("hivemind", workers, launched=100.0) == [(25.0, 80, 3.5)]
    assert alone({"w0": workers[0], "w1": [dict(peers_seen=4)]}) == ["w0 never saw another worker: its replica "
                                                                      "trained alone"]
    curve = Curve("dp", points=[(5.0, 0, 5.5), (20.0, 80, 3.2)])
    assert (curve.at(4.0), curve.at(5.0), curve.at(19.9), curve.at(60.0)) == (None, 5.5, 5.5, 3.2)


def test_the_checkpoint_bench_measures_the_products_snapshot_and_writes_what_a_restart_loads(tmp_path):
    """``bench/checkpoint.py`` stands in for a peer's parts; a part the product's ``snapshot`` reads and the stand-in
    lacks (``local``, once) broke it unseen."""
    from bench.checkpoint import measure
    from peer.ops.checkpoint import CheckpointPayload

    row = measure("micro", 1, 32, str(tmp_path))
    saved = CheckpointPayload.load(str(tmp_path))
    assert row["file"] == (tmp_path / "state.pt").stat().st_size > row["held"] > 0
    assert saved.run_id == "bench" and saved.theta.numel() == saved.params.numel() == row["params"]


def test_the_convergence_sweeps_goal_counts_the_bytes_of_a_run_without_alignment():
    """With a fixed-size codec the sweep's goal computes data-parallel's bytes over the centre's by construction;
    with alignment off (``--align-every 0``) no first moment travels, and the report divided by zero instead."""
    from types import SimpleNamespace

    from bench.convergence import goal

    centre = SimpleNamespace(label="centre", gap=2.37, ratio=10.0, cell=SimpleNamespace(compression="none"))
    args = SimpleNamespace(compression="none", inner_steps=2, align_every=0)
    text = goal([centre], args)
    assert "2 x 32 / 32.00 = 2x" in text and "first moment" not in text
    aligned = goal([centre], SimpleNamespace(compression="none", inner_steps=2, align_every=4))
    assert "2 x 32 / 32.00 / (1 + 1/4) = 2x" in aligned and "first moment every 4 rounds" in aligned


def test_the_codec_table_leaves_out_hiveminds_8_bit_codecs_only_where_numpy_breaks_their_decoders():
    """hivemind 1.1.12's 8-bit decoders call int() on a one-element numpy array, an error from numpy 2.4: the project
    no longer pins numpy below it (no such numpy has a wheel for Python 3.15), so the bench says why those two rows
    are missing rather than failing; with an older numpy they are measured."""
    import numpy

    from bench.compression import hivemind_codecs

    codecs, left_out = hivemind_codecs()
    names = [codec.name for codec in codecs]
    if tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 4):
        assert names == ["hivemind NoCompression", "hivemind Float16Compression"]
        assert f"numpy {numpy.__version__}" in left_out and "numpy<2.4" in left_out, left_out
    else:
        assert names[2:] == ["hivemind Uniform8BitQuantization", "hivemind BlockwiseQuantization"] and not left_out
