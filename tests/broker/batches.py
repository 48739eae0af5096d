"""Test helper: encode Kafka RecordBatch v2 bytes independently of the broker's own code.

Example::

    data = batch([b"a", b"b"], timestamp=1000, producer_id=7, producer_epoch=0, base_sequence=0)
    records = decode(data)          # [(offset, timestamp, key, value)], decoded by kafka-python
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder


def _varint(value: int) -> bytes:
    v = (value << 1) ^ (value >> 63)
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _bytes_field(value: bytes | None) -> bytes:
    return _varint(-1) if value is None else _varint(len(value)) + value


def batch(
    values: Sequence[bytes | None] = (b"value",),
    *,
    keys: Sequence[bytes | None] | None = None,
    timestamp: int = 1_000,
    timestamps: Sequence[int] | None = None,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    transactional: bool = False,
    base_offset: int = 0,
) -> bytes:
    """An uncompressed v2 batch; record i gets ``timestamps[i]`` (default: ``timestamp`` + i)."""
    keys = keys if keys is not None else [None] * len(values)
    stamps = list(timestamps) if timestamps is not None else [timestamp + i for i in range(len(values))]
    base_ts = stamps[0] if stamps else timestamp
    records = bytearray()
    for i, (key, value) in enumerate(zip(keys, values, strict=True)):
        body = b"\x00" + _varint(stamps[i] - base_ts) + _varint(i) + _bytes_field(key) + _bytes_field(value)
        body += _varint(1) + _varint(1) + b"h" + _varint(1) + b"x"  # one header h=x
        records += _varint(len(body)) + body
    attributes = 0x10 if transactional else 0
    after_crc = struct.pack(
        ">hiqqqhii", attributes, len(values) - 1, base_ts, max(stamps, default=base_ts),
        producer_id, producer_epoch, base_sequence, len(values),
    ) + bytes(records)
    crc = crc32c.crc32c(after_crc)
    return struct.pack(">qiibI", base_offset, 9 + len(after_crc), -1, 2, crc) + after_crc


def kafka_batch(values: Sequence[bytes], *, compression: int = 0, timestamp: int = 1_000,
                producer_id: int = -1, producer_epoch: int = -1, base_sequence: int = -1) -> bytes:
    """A batch built by kafka-python (for compressed batches and cross-checks)."""
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=compression, is_transactional=0, producer_id=producer_id,
        producer_epoch=producer_epoch, base_sequence=base_sequence, batch_size=1 << 24)
    for i, value in enumerate(values):
        builder.append(i, timestamp=timestamp + i, key=None, value=value, headers=[])
    return bytes(builder.build())


def decode(data: bytes) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """(offset, timestamp, key, value) of every record in ``data``, decoded by kafka-python."""
    out = []
    records = MemoryRecords(data)
    while (b := records.next_batch()) is not None:
        if b.is_control_batch:
            continue
        out.extend((r.offset, r.timestamp, r.key, r.value) for r in b)
    return out


def batch_offsets(data: bytes) -> list[tuple[int, int]]:
    """(base offset, last offset) of each batch in ``data``."""
    out = []
    pos = 0
    while pos < len(data):
        base, length = struct.unpack_from(">qi", data, pos)
        (delta,) = struct.unpack_from(">i", data, pos + 23)
        out.append((base, base + delta))
        pos += 12 + length
    return out
