"""What a tracker wrote, read back without the tracker: the records of an offline W&B run."""
from __future__ import annotations

import struct


def wandb_records(path):
    """The records of an offline run's ``.wandb`` transaction log: a LevelDB-style log (a 7-byte file header, 32 KiB
    blocks of chunks with a 7-byte header: crc32, length, FULL/FIRST/MIDDLE/LAST) of ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += left
            continue
        buf += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""
