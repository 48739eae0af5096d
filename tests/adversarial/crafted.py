"""Crafted RecordBatch v2 bytes for the attacks: any record count and any record bytes under a valid
CRC, gzip that inflates garbage, and a gzip bomb.

Example::

    body = record(0, b"a") + record(1, b"b")
    data = raw_batch(body, count=3)                     # claims 3 records, holds 2, CRC valid
    data = raw_batch(gzip.compress(b"junk"), count=1, codec=GZIP)
    data = raw_batch(gzip_bomb(), count=1, codec=GZIP)  # 1 MB that inflates to 1 GiB of zeros
"""

from __future__ import annotations

import functools
import struct
import zlib

import crc32c

from twophase.wire.varint import encode_varint

GZIP = 1
ATTR_CONTROL = 0x20
ATTR_TRANSACTIONAL = 0x10


def record(offset_delta: int, value: bytes | None, *, key: bytes | None = None, timestamp_delta: int = 0) -> bytes:
    """One well-formed v2 record without headers."""
    def field(data: bytes | None) -> bytes:
        return encode_varint(-1) if data is None else encode_varint(len(data)) + data

    body = b"\x00" + encode_varint(timestamp_delta) + encode_varint(offset_delta) + field(key) + field(value)
    body += encode_varint(0)
    return encode_varint(len(body)) + body


def raw_batch(records: bytes, count: int, *, codec: int = 0, attributes: int = 0, last_offset_delta: int | None = None,
              timestamp: int = 1_000, producer_id: int = -1, producer_epoch: int = -1,
              base_sequence: int = -1) -> bytes:
    """A batch holding ``records`` as they are, claiming ``count`` records, with a valid CRC."""
    last_delta = count - 1 if last_offset_delta is None else last_offset_delta
    after_crc = struct.pack(">hiqqqhii", codec | attributes, last_delta, timestamp, timestamp, producer_id,
                            producer_epoch, base_sequence, count) + records
    return struct.pack(">qiibI", 0, 9 + len(after_crc), -1, 2, crc32c.crc32c(after_crc)) + after_crc


@functools.cache
def gzip_bomb(inflated_bytes: int = 1 << 30) -> bytes:
    """A single gzip member that inflates to ``inflated_bytes`` zeros (1 GiB: about 1 MB), built in 1 MiB steps."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    parts = [deflater.compress(zeros) for _ in range(inflated_bytes // len(zeros))]
    parts.append(deflater.flush())
    return b"".join(parts)
