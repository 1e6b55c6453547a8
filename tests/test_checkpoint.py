"""Checkpoints are atomic: a corrupt file is named, a failed write keeps the previous checkpoint."""

import errno
import os
import subprocess

import pytest
import torch

import peer.ops.checkpoint as checkpoint
from dht.errors import UserError
from peer.ops.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint


def test_round_trip(tmp_path):
    assert load_checkpoint(str(tmp_path)) is None
    assert save_checkpoint(str(tmp_path), dict(epoch=3, params=torch.arange(5.0), merged={"a": 1}))
    payload = load_checkpoint(str(tmp_path))
    assert payload["epoch"] == 3 and torch.equal(payload["params"], torch.arange(5.0)) and payload["merged"] == {"a": 1}


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, damage):
    save_checkpoint(str(tmp_path), dict(epoch=1, params=torch.zeros(1000)))
    path = checkpoint_path(str(tmp_path))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncate" else b"not a checkpoint at all")
    with pytest.raises(UserError, match="is corrupt or truncated .*; move it away to start this peer fresh"):
        load_checkpoint(str(tmp_path))


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, caplog):
    save_checkpoint(str(tmp_path), dict(epoch=1))

    def no_space(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

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
