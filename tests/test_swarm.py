"""End to end: real ``python -m dht`` and ``python -m peer`` processes on loopback, the micro model."""

from __future__ import annotations

import os
import signal
import statistics

import pytest
import torch

from tests.harness.swarm import Swarm, assert_all_leave, assert_groups_agree, assert_loss_fell, by_epoch, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def swarm(tmp_path):
    swarm = Swarm(tmp_path)
    yield swarm
    swarm.close()


def test_three_peers_agree_learn_and_admit_a_joiner(swarm):
    # the outer lr decays each epoch (to 0.1x by epoch 10): members must compute the same one to stay identical
    decaying = ("--outer-lr-decay", "--lr-decay-steps", "50")
    peers = [swarm.peer(f"p{i}", *decaying) for i in range(3)]
    peers[0].wait_rounds(3, timeout=180)
    joiner = swarm.peer("joiner", *decaying, new_run=False)
    wait_until(lambda: joiner.reached(lambda m: sum(r["applied"] for r in m) >= 3), 240,
               "the joiner to apply 3 outer steps")
    assert "joined run 'diloco' with 3 live peer(s)" in joiner.stderr, joiner.stderr[-3000:]
    assert_all_leave(peers + [joiner], 60)

    assert assert_groups_agree(peers + [joiner]) >= 5 * 3
    table = by_epoch(peers)
    full_rounds = [epoch for epoch, records in table.items()
                   if len(records) == 3 and len({r["state_hash"] for r in records.values()}) == 1]
    assert len(full_rounds) >= 5, f"fewer than 5 rounds in which all 3 peers agreed: {sorted(full_rounds)}; " \
        + "; ".join(f"{p.name}: " + " ".join(f"{r['epoch']}{'+' if r['applied'] else '-'}{r.get('outcome', '')}"
                                            for r in p.metrics) for p in peers + [joiner])
    assert_loss_fell(peers)

    # the joiner downloaded the swarm's state, so its first outer step lands on the swarm's next hash,
    # in a group with the others; and it is in the swarm's groups from then on
    joined = [r for r in joiner.metrics if r["applied"]]
    assert joined, joiner.stderr[-3000:]
    first = joined[0]
    assert {r["state_hash"] for r in table[first["epoch"]].values()} == {first["state_hash"]}
    later = [epoch for epoch in table if first["epoch"] <= epoch <= joined[-1]["epoch"]]
    assert len(later) >= 3
    for epoch in later:  # a member whose all-reduce failed after the others merged its delta adopts their state,
        groups = [r["group"] for r in table[epoch].values() if r["group"]]  # and its record names no group
        assert groups and all(first["peer_id"] in group for group in groups), f"joiner missing from a group at {epoch}"


def test_lone_peer_learns_and_resumes_from_checkpoint(swarm, tmp_path):
    checkpoint = str(tmp_path / "ckpt")
    first = swarm.peer("lone", "--max-rounds", "6", "--checkpoint-dir", checkpoint, join=False)
    assert first.wait(180) == 0, first.stderr[-2000:]
    rounds = first.metrics
    assert [r["epoch"] for r in rounds] == [1, 2, 3, 4, 5, 6]
    assert all(r["group_size"] == 1 for r in rounds)
    assert rounds[-1]["loss"] < rounds[0]["loss"] - 0.5

    saved = torch.load(f"{checkpoint}/state.pt", weights_only=True)
    assert saved["epoch"] == 6 and saved["residual"].abs().sum() > 0  # the error-feedback residual is kept too

    resumed = swarm.peer("resumed", "--max-rounds", "8", "--checkpoint-dir", checkpoint, join=False)
    assert resumed.wait(180) == 0, resumed.stderr[-2000:]
    after = resumed.metrics
    assert after[0]["epoch"] == 7 and after[0]["peer_id"] == rounds[0]["peer_id"]
    # the restored state is the one saved, bit for bit: hash(G, m, e) of the last round before the stop
    assert after[0]["resumed_hash"] == rounds[-1]["state_hash"], "the resumed peer lost its progress"
    assert rounds[0]["resumed_hash"] is None and after[1]["resumed_hash"] is None  # a restart's first record only
    assert 0 < after[0]["startup_seconds"] < 60 and after[1]["startup_seconds"] is None
    assert after[0]["loss"] < rounds[0]["loss"] - 0.5, "the resumed peer trains like a fresh one"
    assert after[0]["tokens_total"] == rounds[-1]["tokens_total"] + after[0]["tokens"]


def test_a_peer_whose_state_copy_would_not_fit_in_memory_writes_its_checkpoints_in_place(swarm, tmp_path,
                                                                                            monkeypatch):
    """A 150m peer on a 24-GiB machine was OOM-killed writing its first checkpoint from a copy of the state. A peer
    whose copy would not fit in the memory free (here 1 MiB, as the peer's process is told) writes the live tensors on
    its training thread instead, says so once, and what it wrote resumes bit for bit."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import peer.ops.checkpoint\n"
        "peer.ops.checkpoint.memory_free = lambda: 1 << 20\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))
    checkpoint = str(tmp_path / "ckpt")
    short = swarm.peer("short", "--max-rounds", "3", "--checkpoint-dir", checkpoint, join=False)
    assert short.wait(180) == 0, short.stderr[-2000:]
    assert short.stderr.count("checkpoints are written on the training thread: a copy of the state") == 1, \
        short.stderr[-2000:]
    monkeypatch.undo()
    resumed = swarm.peer("resumed", "--max-rounds", "4", "--checkpoint-dir", checkpoint, join=False)
    assert resumed.wait(180) == 0, resumed.stderr[-2000:]
    assert "checkpoints are written on the training thread" not in resumed.stderr
    assert resumed.metrics[0]["epoch"] == 4 and resumed.metrics[0]["resumed_hash"] == short.metrics[-1]["state_hash"]


def test_a_resume_that_the_flags_or_the_swarm_refuse_is_one_line_and_keeps_the_checkpoint(swarm, tmp_path):
    """A resumed peer builds its model from its checkpoint while its DHT starts, before the swarm answers
    (peer/round/build.py); a flag or a swarm's run that disagree with the checkpoint still end in one line, and the
    checkpoint is as it was."""
    checkpoint = tmp_path / "ckpt"
    lone = swarm.peer("lone", "--max-rounds", "1", "--checkpoint-dir", str(checkpoint), join=False)
    assert lone.wait(120) == 0, lone.stderr[-2000:]
    saved = (checkpoint / "state.pt").read_bytes()
    swarm.peer("other", "--inner-steps", "7").wait_rounds(1, timeout=120)  # the swarm's 'diloco': another config
    for name, flags, says in (("flag", ("--model", "small"), "--model small conflicts with run 'diloco'"),
                              ("swarm", ("--initial-peers", swarm.maddr, "--inner-steps", "7"),
                               "belongs to another configuration of run 'diloco'")):
        refused = swarm.peer(name, "--checkpoint-dir", str(checkpoint), *flags, join=False)
        assert refused.wait(120) == 2, refused.stderr[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0] and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert (checkpoint / "state.pt").read_bytes() == saved


@pytest.mark.parametrize("overlap", ["--no-overlap", "--overlap"])
def test_a_peer_killed_mid_round_resumes_the_round_and_its_tokens_count(swarm, tmp_path, overlap):
    """With --checkpoint-every, a peer SIGKILLed mid-round loses at most that much work: the restart resumes the
    partial round (theta, AdamW state, data position) and its next outer step counts that round's tokens too. With
    --overlap the checkpoint comes once the last round's sync has ended: what it merged is not pending any more."""
    checkpoint = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(checkpoint), "--checkpoint-every", "1", "--inner-steps", "20",
             "--min-step-seconds", "0.2", overlap)  # rounds of 4 s, checkpointed about every second

    def early_in_a_round():
        try:
            saved = torch.load(checkpoint / "state.pt", weights_only=True)
        except (OSError, RuntimeError, EOFError):
            return None
        return saved["epoch"] >= 1 and 0 < saved["round_steps"] <= 10  # the round's end is 2 s or more away

    first = swarm.peer("crashing", *flags, join=False)
    wait_until(early_in_a_round, 120, "a checkpoint early in a round")
    first.signal(signal.SIGKILL)
    assert first.wait(30) == -signal.SIGKILL
    saved = torch.load(checkpoint / "state.pt", weights_only=True)
    assert saved["round_steps"] > 0 and saved["pending_tokens"] == saved["round_steps"] * 4 * 64

    resumed = swarm.peer("resumed", *flags, "--max-rounds", str(saved["rounds"] + 1), join=False)  # one more
    assert resumed.wait(180) == 0, resumed.stderr[-2000:]
    assert f"{saved['round_steps']} steps into a round" in resumed.stderr, resumed.stderr[-2000:]
    record = resumed.metrics[0]
    assert record["epoch"] == saved["epoch"] + 1
    # the outer step merged the partial round's tokens with the round trained after the restart: nothing lost
    assert record["tokens_total"] == saved["tokens_total"] + saved["pending_tokens"] + record["tokens"]


def contributed(records, index):
    """Tokens behind the contribution of ``records[index]`` (applied): its round's and those of the unapplied
    rounds since the peer's previous applied one, or since a round that dropped its work: a restart whose first
    download failed trains a round on its resumed state, then finds that state's work merged and resets to the
    swarm's state, dropping that round too (seen on a loaded machine)."""
    start = max((i for i in range(index) if records[i]["applied"] or records[i]["outcome"] == "resumed_merged"),
                default=-1) + 1
    return sum(r["tokens"] for r in records[start:index + 1])


def test_work_merged_before_a_peer_died_is_not_sent_again_by_its_restart(swarm, tmp_path):
    """A peer dies after its group merged its round, while writing that round's checkpoint: its last checkpoint
    is a mid-round one, holding that round's work as unmerged. The restart finds the swarm's state merged it
    and drops its copy: the first outer step it joins adds exactly the tokens trained since.

    The kill comes 2 s after the checkpoint's write began (the write held meanwhile): killed at once, the victim's
    averager had not yet sent the survivor its averaged part (CI: "sent 0 of 1 averaged parts"), so the group had
    not merged the round after all, and the restart rightly sent its work again."""
    checkpoint = tmp_path / "victim"
    flags = ("--inner-steps", "20", "--min-step-seconds", "0.2")  # rounds of 4 s: mid-round checkpoints each second
    victim_flags = ("--checkpoint-dir", str(checkpoint), "--checkpoint-every", "1")
    survivor = swarm.peer("survivor", *flags)
    victim = swarm.peer("victim", *flags, *victim_flags, faults="kill@checkpoint:2+2")
    wait_until(lambda: not victim.alive(), 180, "the kill while writing a round's checkpoint")
    assert victim.popen.returncode == -signal.SIGKILL and victim.metrics[-1]["applied"], victim.stderr[-3000:]
    saved = torch.load(checkpoint / "state.pt", weights_only=True)
    assert saved["round_steps"] > 0 and saved["epoch"] == victim.metrics[-1]["epoch"] - 1

    restarted = swarm.peer("restarted", *flags, *victim_flags)
    wait_until(lambda: restarted.reached(lambda m: any(r["applied"] and r["group_size"] == 2 for r in m)), 120,
               "the restart to apply a round with the survivor")
    assert "the swarm merged the work this peer resumed from its checkpoint" in restarted.stderr, \
        restarted.stderr[-3000:]
    assert_all_leave((survivor, restarted), 60)
    after = restarted.metrics
    index = next(i for i, r in enumerate(after) if r["applied"] and r["group_size"] == 2)
    epoch = after[index]["epoch"]
    mine = survivor.metrics
    here = next(i for i, r in enumerate(mine) if r["epoch"] == epoch and r["applied"])
    before = max(r["tokens_total"] for r in mine if r["epoch"] == epoch - 1)
    assert after[index]["tokens_total"] - before == contributed(after, index) + contributed(mine, here)


def test_unmerged_work_past_max_staleness_is_dropped_for_the_global_state(swarm, tmp_path):
    """A peer whose work goes unmerged (here: alone below --quorum 2) for more than --max-staleness rounds
    drops it and trains from the global state again, instead of drifting ever further from it."""
    checkpoint = tmp_path / "ckpt"
    lone = swarm.peer("lone", "--quorum", "2", "--max-staleness", "1", "--max-rounds", "2",
                      "--checkpoint-dir", str(checkpoint), join=False)
    assert lone.wait(180) == 0, lone.stderr[-2000:]
    assert [(r["applied"], r["stale"], r["epoch"]) for r in lone.metrics] == [(False, 0, 0), (False, 1, 0)]
    assert all(r["error"] == "no group of at least 2 peers formed" for r in lone.metrics)
    assert "not applied: no group of at least 2 peers formed" in lone.stderr  # the troubleshooting table's line
    assert ("2 rounds of work went unmerged, past --max-staleness 1: dropping them and resyncing to the global "
            "state") in lone.stderr
    saved = torch.load(checkpoint / "state.pt", weights_only=True)
    assert torch.equal(saved["theta"], saved["params"]), "the local model was not reset to the global state"
    assert saved["pending_rounds"] == 0 and saved["pending_tokens"] == 0


@pytest.mark.parametrize("stop", ["SIGTERM to the peer", "Ctrl+C to its process group"])
def test_stop_checkpoints_and_exits_zero(swarm, tmp_path, stop):
    checkpoint = tmp_path / "ckpt"
    peer = swarm.peer("lone", "--checkpoint-dir", str(checkpoint), join=False)
    peer.wait_rounds(2, timeout=180)
    if stop.startswith("SIGTERM"):
        peer.signal(signal.SIGTERM)
    else:  # a terminal signals every process of the foreground group, the p2p daemon included
        os.killpg(peer.popen.pid, signal.SIGINT)
    assert peer.wait(30) == 0, peer.stderr[-2000:]
    assert (checkpoint / "state.pt").exists()
    assert "leaving after the current step" in peer.stderr
    assert "Traceback" not in peer.stderr, peer.stderr[-3000:]


def test_sigterm_to_the_whole_process_group_mid_sync_still_leaves_cleanly(swarm, tmp_path):
    """torchrun, systemd and ``pkill -f "python -m peer"`` send SIGTERM to the peer's forked DHT and averager
    processes too. They leave it to the peer: with its sync in flight (overlap, a partner), it finishes the round,
    checkpoints and leaves with its own line. Before, they died at once, and the sync waited on them until torchrun
    SIGKILLed the peer 30 s later (an island's rank 0: no checkpoint, no line)."""
    checkpoint = tmp_path / "ckpt"
    first = swarm.peer("first", "--overlap")
    second = swarm.peer("second", "--overlap", "--checkpoint-dir", str(checkpoint))
    wait_until(lambda: sum(len(records) == 2 for records in by_epoch([first, second]).values()) >= 2, 180,
               "the two peers to apply 2 rounds together")
    os.killpg(second.popen.pid, signal.SIGTERM)
    assert second.wait(20) == 0, second.stderr[-3000:]  # well inside torchrun's 30 s (it took 37-60+ s before)
    assert "SIGTERM: leaving after the current step" in second.stderr
    assert (checkpoint / "state.pt").exists()
    assert "Traceback" not in second.stderr, second.stderr[-3000:]
    rounds = len(first.metrics)
    first.wait_rounds(rounds + 2, 60)  # the partner trains on


def test_quantized_rounds_shrink_the_wire_and_keep_states_identical(swarm):
    """Three runs of 2 peers side by side, fp32, int8 and int4: bytes measured at the transport, per peer and
    round. (2 peers a run: with 3, nine peers on two cores made rounds of ~1 s compute and ~2 s sync, and a
    peer that missed one group kept missing them.) Each run lasts until both its peers applied 3 rounds
    together: a fixed --max-rounds failed in CI when one peer started 3 rounds before the other."""
    sent = {}
    runs = {codec: [swarm.peer(f"{codec}-{i}", "--compression", codec, "--align-every", "0",
                               "--run-id", f"codec-{codec}") for i in range(2)]
            for codec in ("none", "int8", "int4")}  # three runs side by side on one bootstrap
    every = [peer for peers in runs.values() for peer in peers]

    def paired(metrics):
        return sum(r["applied"] and r["group_size"] == 2 for r in metrics) >= 3

    wait_until(lambda: all(peer.reached(paired) for peer in every), 300,
               "every peer to apply 3 rounds with its partner")
    for peer in every:
        peer.signal(signal.SIGTERM)
    for codec, peers in runs.items():
        for peer in peers:
            assert peer.wait(60) == 0, peer.stderr[-3000:]
        assert assert_groups_agree(peers) >= 3 * 2
        assert_loss_fell(peers)
        full = [r["bytes_sent"] for peer in peers for r in peer.metrics if r["applied"] and r["group_size"] == 2]
        sent[codec] = statistics.median(full)  # the median skips a round that also served a state download
    assert sent["int8"] <= 0.27 * sent["none"], sent
    assert sent["int4"] <= 0.14 * sent["none"], sent



def test_a_swarm_larger_than_its_group_size_meets_in_groups_and_ends_each_round_on_one_state(swarm):
    """5 peers in groups of about 2: three groups a round (one, with a peer missing: never two), whose delegates
    average across groups and serve the result to their groupmates. Every round merges all five but a peer that was
    late for it (which keeps its work for the next round), on average at least four, and every peer that applies it
    holds one hash."""
    peers = [swarm.peer(f"p{i}", "--group-size", "2") for i in range(5)]
    wait_until(lambda: all(p.reached(lambda m: sum(r["applied"] and r["groups"] >= 2 for r in m) >= 4)
                           for p in peers), 240, "every peer to apply 4 rounds merged across groups")
    assert_all_leave(peers, 60)
    assert assert_groups_agree(peers) >= 4 * 5 * 4
    merged = [r for p in peers for r in p.metrics if r["applied"] and r["groups"] >= 2]
    ids = {p.metrics[0]["peer_id"]: p for p in peers}
    for record in merged:
        for missing in set(ids) - set(record["group"]):
            # it was still starting or downloading the state, or its sync of that round ended at the epoch before
            # (no group, or the records came too late to meet one, or its group was a minority, which adopted the
            # majority's state as that state's holders began their next round or did not see it in time), or the
            # sync that spanned it ended after it, at whatever epoch it caught up to (one slow catch-up can span
            # several short rounds): either way it keeps its work for the next round. Or it caught up past that
            # round within its round or sync (its record says rebased), and its work went into the next.
            theirs = {r["outcome"] for r in ids[missing].metrics if record["epoch"] - r["epoch"] == 1}
            spanning = next((r for r in ids[missing].metrics if r["epoch"] >= record["epoch"]), None)
            theirs |= {spanning["outcome"]} if spanning else set()
            # a sync (or a round) that caught up past it, its work rebased, and then applied at the adopted state
            theirs |= {"caught_up"} if spanning and spanning["rebased"] else set()
            starting = ids[missing].metrics[0]["epoch"] > record["epoch"]
            late = {"missed_group", "no_group", "caught_up", "records_late", "minority_adopted", "minority"}
            assert starting or theirs & late, \
                f"{ids[missing].name} left out of epoch {record['epoch']}: " \
                + " ".join(f"{r['epoch']}:{r['outcome']}" for r in ids[missing].metrics)
    # once all five run, a round merges at least 4 of them on average: a peer out of a round is there for one of the
    # late reasons above, and under load (two of these swarms at once on 2 cores) a peer starved of CPU misses a few
    # rounds in a row (measured over 16 such runs: 4.24 to 5.00 on average; "half the rounds hold all five", the
    # check before, failed 3 of them)
    started = max(peer.metrics[0]["epoch"] for peer in peers)
    sizes = [(r["epoch"], r["group_size"]) for r in merged if r["epoch"] > started]
    assert sizes and sum(size for _, size in sizes) >= 4 * len(sizes), sizes
    for epoch, records in by_epoch(peers).items():
        assert len({r["state_hash"] for r in records.values()}) == 1, f"epoch {epoch} holds two states"
    assert_loss_fell(peers)


def test_peers_train_together_where_forkserver_is_the_default_start_method(swarm):
    """Python 3.14 makes forkserver multiprocessing's default on Linux; it pickles a child process instead of
    forking it, and hivemind's averager (our parts' closures, the running DHT) cannot be pickled: the peer died at
    start with a traceback. Two peers started that way, overlap on as by default, must train together."""
    peers = [swarm.peer(f"p{i}", "--overlap", start_method="forkserver") for i in range(2)]

    def paired(metrics):
        return sum(r["applied"] and r["group_size"] == 2 for r in metrics) >= 2

    wait_until(lambda: all(peer.reached(paired) for peer in peers), 180, "both peers to apply 2 rounds together")
    assert_all_leave(peers, 60)
    assert assert_groups_agree(peers) >= 2 * 2
    assert all("Traceback" not in peer.stderr for peer in peers), peers[0].stderr[-3000:]
