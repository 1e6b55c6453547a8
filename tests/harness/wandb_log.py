"""Read an offline W&B run's transaction log (``run-ID.wandb``): the records it would sync, as protobufs.

wandb 0.31 keeps no Python reader of its own format: a 7-byte header (``:W&B``, a magic and a version), then
32 KiB blocks of records, each a 7-byte header (CRC-32, length, kind: full, first, middle or last piece) and a
piece of a serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a record header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:
            break
        piece, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        pending = piece if kind in (FULL, FIRST) else pending + piece
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def run_and_steps(path: Path):
    """(the run record: run_id, run_group, ...; [(step, {key: value})] of its history)."""
    import json

    run, history = None, []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append((record.history.step.num, items))
    return run, history
