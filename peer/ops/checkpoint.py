"""Atomic checkpoints, written off the training path: a crash or a full disk at any moment leaves the previous
checkpoint intact, and an inner step never waits for the disk.

A checkpoint is one ``torch.save`` file, written to a temporary name in the same directory, flushed
and fsynced, then renamed over the old one (rename is atomic on POSIX), and the directory is fsynced
so the rename itself survives a power cut. What a peer saves in it, and resumes from, is one
``CheckpointPayload``: a snapshot in memory (``frozen`` copies), taken between two inner steps, that a
``CheckpointWriter`` thread writes while training goes on.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import pickle
import threading
import zipfile
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional

import torch

from dht.errors import UserError

logger = logging.getLogger(__name__)

FILENAME = "state.pt"
FORMAT = 1
WRITER_NICENESS = 10  # the checkpoint writer thread's, above the training threads' 0


def checkpoint_path(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def save_checkpoint(directory: str, payload: Dict[str, Any],
                    before_rename: Optional[Callable[[], None]] = None) -> bool:
    """Write ``payload`` atomically; on failure (a full disk, say) keep the old file and return False.
    ``before_rename`` runs once the temporary file is on disk (fault plans strike there)."""
    final = checkpoint_path(directory)
    temporary = f"{final}.tmp.{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            torch.save(dict(payload, format=FORMAT), f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(temporary, final)
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        return True
    except (OSError, RuntimeError) as failure:
        e = _os_error(failure)
        if e is None:
            raise
        reason = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or repr(e)
        logger.error(f"checkpoint not written to {final}: {reason}; the previous checkpoint is kept. "
                     f"Free some space and training will checkpoint again next round")
        try:
            os.remove(temporary)
        except OSError:
            pass
        return False


def _os_error(error: BaseException) -> Optional[OSError]:
    """The OSError behind ``error``: torch.save's zip writer turns a full disk (ENOSPC) into a RuntimeError
    ("unexpected pos ...") raised while cleaning up, with the OSError as its context."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def load_checkpoint(directory: str) -> Optional[Dict[str, Any]]:
    """The saved payload, ``None`` if there is none; a ``UserError`` if the file is corrupt."""
    path = checkpoint_path(directory)
    for leftover in glob.glob(f"{glob.escape(path)}.tmp.*"):  # a write interrupted by a crash: never renamed
        logger.info(f"removing {leftover}, an interrupted checkpoint write; {path} is the last complete one")
        os.remove(leftover)
    if not os.path.exists(path):
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as e:
        raise UserError(
            f"checkpoint {path} is corrupt or truncated ({str(e).splitlines()[0][:120]}); move it away to "
            f"start this peer fresh (it will download the swarm's state), or restore a backup"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not a decoupled-diloco checkpoint of format {FORMAT}; move it away")
    return payload


@dataclass
class CheckpointPayload:
    """Everything a restarted peer resumes from, saved and restored as one."""

    manifest_hash: str  # the run configuration it belongs to; a checkpoint of another is refused
    manifest_record: Dict[str, Any]  # the signed manifest, so that a restart alone can go on with the run
    run_id: str
    peer_id: str
    params: torch.Tensor  # G
    momentum: torch.Tensor  # m
    epoch: int
    tokens_total: int
    merged: Dict[str, int]  # peer id -> last epoch its delta was merged into this lineage
    theta: torch.Tensor  # the local model, flat
    optimizer: Dict[str, Any]  # AdamW's state dict
    local_steps: int  # steps of that optimizer (its warmup)
    data_position: int  # where this peer's data order stands
    pending_tokens: int  # tokens of work not merged yet, the round in progress included
    pending_rounds: int
    rounds: int
    manifest_settings: Dict[str, Any] = field(default_factory=dict)
    round_steps: int = 0  # mid-round: steps of the round in progress, in theta
    last_loss: Optional[float] = None
    residual: Optional[torch.Tensor] = None  # error feedback's residual
    carried: Optional[torch.Tensor] = None  # our deltas that only a lineage we left merged, not sent yet
    recovered_tokens: int = 0  # the tokens behind them

    def save(self, directory: str, before_rename: Optional[Callable[[], None]] = None) -> bool:
        # not dataclasses.asdict: it deep-copies every tensor
        return save_checkpoint(directory, {f.name: getattr(self, f.name) for f in fields(self)}, before_rename)

    @classmethod
    def load(cls, directory: str) -> Optional["CheckpointPayload"]:
        """The saved payload, None if there is none; a ``UserError`` for a corrupt file or another format."""
        saved = load_checkpoint(directory)
        if saved is None:
            return None
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in saved.items() if k in known})
        except TypeError as e:  # a required field is missing
            raise UserError(f"checkpoint {checkpoint_path(directory)} is incomplete ({e}); move it away to start "
                            f"this peer fresh (it will download the swarm's state)") from None



def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (dicts, lists and tuples walked): what ``frozen`` would copy."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def memory_free() -> Optional[int]:
    """Bytes of memory the system can give us now without swapping: Linux's ``MemAvailable`` (free memory and the
    page cache it can drop). None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def frozen(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (dicts, lists and tuples walked): a snapshot that the
    training steps after it cannot change, such as AdamW's state dict, whose tensors the next step updates in place."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(frozen(v) for v in value)
    return value


class CheckpointWriter:
    """Writes checkpoints on a thread of its own, one at a time: ``submit`` hands it a snapshot and returns at once.

    A snapshot submitted while another is being written waits in one slot; a newer one replaces it there (the
    older is never written): never two writes at once, never a queue that grows. So the memory held is one
    snapshot while a write runs, two when the next is due before the write ends (a disk slower than the checkpoint
    interval). ``wait`` and ``close`` return once the last snapshot submitted is on disk (or failed: ``save_checkpoint``
    logs why and keeps the previous checkpoint). ``save``: how a payload is written (tests inject a slow disk)."""

    def __init__(self, directory: str, save: Optional[Callable[..., bool]] = None):
        self.directory = directory
        self._save = save or (lambda directory, payload, before_rename: payload.save(directory, before_rename))
        self._changed = threading.Condition()
        self._pending: Optional[tuple] = None  # (payload, before_rename), not started yet
        self._writing = False
        self._closed = False
        self.written = 0  # snapshots written (or failed), for the tests
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, payload: "CheckpointPayload", before_rename: Optional[Callable[[], None]] = None) -> None:
        with self._changed:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed")
            self._pending = (payload, before_rename)
            self._changed.notify_all()

    @property
    def busy(self) -> bool:
        with self._changed:
            return self._writing or self._pending is not None

    def write_now(self, payload: "CheckpointPayload", before_rename: Optional[Callable[[], None]] = None) -> bool:
        """Write ``payload`` in the calling thread, once any write in progress has ended (and what waits in the slot,
        which this newer one replaces): for a payload of live tensors, not a snapshot, that must be on disk before
        they change."""
        with self._changed:
            self._pending = None
            self._changed.wait_for(lambda: not self._writing)
            self._writing = True
        try:
            return self._save(self.directory, payload, before_rename)
        except Exception:  # as in the writer's thread: a bug, said once, and training goes on
            logger.exception(f"checkpoint not written to {checkpoint_path(self.directory)}")
            return False
        finally:
            with self._changed:
                self._writing = False
                self.written += 1
                self._changed.notify_all()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Until every snapshot submitted so far is written (or replaced); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._writing and self._pending is None, timeout)

    def close(self) -> None:
        """Write the last snapshot submitted, then stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:  # Linux: this thread alone yields the CPU to the training threads (a write may take longer, not a step)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed, and nothing left to write
                (payload, before_rename), self._pending = self._pending, None
                self._writing = True
            try:
                self._save(self.directory, payload, before_rename)
            except Exception:  # anything save_checkpoint does not turn into its one-line error: a bug, said once
                logger.exception(f"checkpoint not written to {checkpoint_path(self.directory)}")
            finally:
                del payload  # the snapshot's memory goes before the next one is taken from the slot
                with self._changed:
                    self._writing = False
                    self.written += 1
                    self._changed.notify_all()
