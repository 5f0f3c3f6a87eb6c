"""Read a wandb offline run file (``run-<id>.wandb``) without wandb's own reader, which wandb 0.31 no longer
ships in Python: a 7-byte header (":W&B", magic, version), then LevelDB's log format (32 KiB blocks of
records with a 7-byte header: CRC32C, little-endian length, type FULL/FIRST/MIDDLE/LAST), each record a
protobuf ``wandb.proto.wandb_internal_pb2.Record``."""
from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a wandb run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            pending = chunk
        elif kind == FIRST:
            pending = chunk
            continue
        elif kind == MIDDLE:
            pending += chunk
            continue
        else:
            pending += chunk
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


def history(path: Path) -> list[dict]:
    """Every ``run.log`` call's numbers, as dicts (key -> value)."""
    import json

    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
