"""Checkpoints are atomic: a corrupt file is named, a failed write keeps the previous checkpoint; they are written on
a thread of their own, so the inner steps never wait for the disk."""

import errno
import os
import subprocess
import threading

import pytest
import torch

import peer.ops.checkpoint as checkpoint
from dht.errors import UserError
from peer.ops.checkpoint import (
    CheckpointPayload,
    CheckpointWriter,
    checkpoint_path,
    frozen,
    load_checkpoint,
    save_checkpoint,
)


def test_round_trip(tmp_path):
    assert load_checkpoint(str(tmp_path)) is None
    assert save_checkpoint(str(tmp_path), dict(epoch=3, params=torch.arange(5.0), merged={"a": 1}))
    payload = load_checkpoint(str(tmp_path))
    assert payload["epoch"] == 3 and torch.equal(payload["params"], torch.arange(5.0)) and payload["merged"] == {"a": 1}


def payload(**changes):
    fields = dict(manifest_hash="h", manifest_record={"settings": {}}, run_id="r", peer_id="p", params=torch.ones(4),
                  momentum=torch.zeros(4), epoch=3, tokens_total=120, merged={"p": 2}, theta=torch.ones(4),
                  optimizer={"state": {}, "param_groups": []}, local_steps=7, data_position=11, pending_tokens=40,
                  pending_rounds=1, rounds=5, carried=torch.full((4,), 0.5), recovered_tokens=9)
    return CheckpointPayload(**dict(fields, **changes))


def test_the_payload_a_peer_saves_is_the_one_it_restores(tmp_path):
    saved = payload()
    assert saved.save(str(tmp_path))
    restored = CheckpointPayload.load(str(tmp_path))
    for name, value in vars(saved).items():
        other = getattr(restored, name)
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value, name


def test_a_checkpoint_missing_a_field_is_a_one_line_error(tmp_path):
    fields = {k: v for k, v in vars(payload()).items() if k != "theta"}
    save_checkpoint(str(tmp_path), fields)
    with pytest.raises(UserError, match="is incomplete .*theta.*; move it away"):
        CheckpointPayload.load(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, damage):
    save_checkpoint(str(tmp_path), dict(epoch=1, params=torch.zeros(1000)))
    path = checkpoint_path(str(tmp_path))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint at all")
    with pytest.raises(UserError, match="is corrupt or truncated .*; move it away to start this peer fresh"):
        load_checkpoint(str(tmp_path))


def no_space(_fd):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    save_checkpoint(str(tmp_path), dict(epoch=1))
    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    assert not save_checkpoint(str(tmp_path), dict(epoch=2))
    assert "the disk is full; the previous checkpoint is kept" in caplog.text
    monkeypatch.undo()
    assert load_checkpoint(str(tmp_path))["epoch"] == 1
    assert os.listdir(tmp_path) == ["state.pt"]  # no temporary file left behind


@pytest.fixture
def small_disk(tmp_path):
    """A real 512 KiB filesystem (tmpfs), where mounting one is allowed (root on Linux)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root on Linux)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_really_full_disk_keeps_the_previous_checkpoint(small_disk, caplog):
    """No mock: the second checkpoint does not fit beside the first on a 512 KiB filesystem."""
    save_checkpoint(str(small_disk), dict(epoch=1, params=torch.ones(50_000)))  # 200 KB
    assert not save_checkpoint(str(small_disk), dict(epoch=2, params=torch.ones(100_000)))  # 400 KB more
    assert "the disk is full; the previous checkpoint is kept" in caplog.text
    saved = load_checkpoint(str(small_disk))
    assert saved["epoch"] == 1 and torch.equal(saved["params"], torch.ones(50_000))
    assert os.listdir(small_disk) == ["state.pt"]  # no temporary file left behind


def test_inner_steps_go_on_while_a_slow_disk_writes_and_the_newest_snapshot_is_written_next(tmp_path):
    """A disk stuck in the first write (an injected one, released by an event): the inner steps run meanwhile; of
    two snapshots taken during that write, the newer replaces the older; close() returns once it is on disk, and
    what is on disk is the snapshot as taken, not the model the steps after it changed."""
    from peer.config import RunConfig
    from peer.train.inner import InnerTrainer
    from peer.train.model import build_model

    writing, release, written = threading.Event(), threading.Event(), []

    def stuck_disk(directory, saved, before_rename):
        writing.set()
        assert release.wait(60), "the test never released the disk"
        written.append(saved.epoch)
        return saved.save(directory, before_rename)

    run = RunConfig(model="micro", seq_len=16, batch_size=2).resolved()
    trainer = InnerTrainer(build_model("micro", 256, 16, seed=0), run, torch.device("cpu"))
    batches = iter(lambda: torch.randint(0, 256, (2, 16)), None)
    trainer.train(batches, 1, 0)  # AdamW has state to snapshot

    def snapshot(epoch):
        theta = torch.cat([p.detach().flatten() for p in trainer.params])
        return payload(epoch=epoch, theta=theta, optimizer=frozen(trainer.optimizer.state_dict()))

    writer = CheckpointWriter(str(tmp_path), save=stuck_disk)
    writer.submit(snapshot(1))
    assert writing.wait(60)  # the write is under way, and the disk does not answer
    assert trainer.train(batches, 3, 0).steps == 3  # the inner steps do not wait for it
    writer.submit(snapshot(2))  # waits in the slot ...
    trainer.train(batches, 1, 0)
    last = snapshot(3)
    writer.submit(last)  # ... and is replaced by a newer one, never written
    trainer.train(batches, 1, 0)  # the live model and AdamW state move on past the snapshot
    assert writer.busy and written == [] and not writer.wait(timeout=0)
    release.set()
    writer.close()
    assert written == [1, 3] and writer.written == 2
    saved = CheckpointPayload.load(str(tmp_path))
    assert saved.epoch == 3 and torch.equal(saved.theta, last.theta)
    moments = [state["exp_avg"] for state in saved.optimizer["state"].values()]
    assert all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, last.optimizer["state"].values()))
    live = [trainer.optimizer.state[p]["exp_avg"] for p in trainer.params]
    assert not all(torch.equal(a, b) for a, b in zip(moments, live))


def test_a_full_disk_under_the_writer_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    writer = CheckpointWriter(str(tmp_path))
    writer.submit(payload(epoch=1))
    assert writer.wait(60)
    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    writer.submit(payload(epoch=2))
    writer.close()
    monkeypatch.undo()
    assert "the disk is full; the previous checkpoint is kept" in caplog.text
    assert CheckpointPayload.load(str(tmp_path)).epoch == 1 and os.listdir(tmp_path) == ["state.pt"]


def test_a_write_in_place_waits_for_the_write_in_progress_and_replaces_the_one_in_the_slot(tmp_path):
    """Where a snapshot would not fit in memory, the training thread writes the live tensors itself
    (``CheckpointWriter.write_now``): after the write in progress, in place of the snapshot waiting in the slot
    (older than it), in the caller's thread."""
    writing, release, written = threading.Event(), threading.Event(), []

    def slow_disk(directory, saved, before_rename):
        if saved.epoch == 1:
            writing.set()
            assert release.wait(60), "the test never released the disk"
        written.append((saved.epoch, threading.current_thread().name))
        return saved.save(directory, before_rename)

    writer = CheckpointWriter(str(tmp_path), save=slow_disk)
    writer.submit(payload(epoch=1))
    assert writing.wait(60)
    writer.submit(payload(epoch=2))  # waits in the slot
    threading.Timer(0.2, release.set).start()
    assert writer.write_now(payload(epoch=3))  # returns once on disk
    writer.close()
    assert written == [(1, "checkpoint-writer"), (3, threading.current_thread().name)] and writer.written == 2
    assert CheckpointPayload.load(str(tmp_path)).epoch == 3
