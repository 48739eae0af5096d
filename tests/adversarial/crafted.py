"""Crafted RecordBatch v2 bytes for the attacks: any record count and any record bytes under a valid
CRC, compressed data that inflates garbage, and a bomb of each codec.

Example::

    body = record(0, b"a") + record(1, b"b")
    data = raw_batch(body, count=3)                     # claims 3 records, holds 2, CRC valid
    data = raw_batch(gzip.compress(b"junk"), count=1, codec=GZIP)
    data = raw_batch(gzip_bomb(), count=1, codec=GZIP)  # 1 MB that inflates to 1 GiB of zeros
    data = raw_batch(zstd_bomb(), count=1, codec=ZSTD)   # 32 KB that inflates to 1 GiB of zeros
"""

from __future__ import annotations

import functools
import struct
import zlib

import cramjam
import crc32c

from twophase.wire.varint import encode_varint

GZIP, SNAPPY, LZ4, ZSTD = 1, 2, 3, 4
MIB = 1 << 20
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


@functools.cache
def snappy_bomb(inflated_bytes: int = 128 * MIB) -> bytes:
    """snappy-java framing of ``inflated_bytes`` zeros (128 MiB: about 6 MB; snappy inflates 21-fold at most)."""
    block = bytes(cramjam.snappy.compress_raw(bytes(MIB)))
    framed = len(block).to_bytes(4, "big") + block
    return b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1) + framed * (inflated_bytes // MIB)


def snappy_declaring(inflated_bytes: int = 1 << 30) -> bytes:
    """Raw snappy whose length prefix declares ``inflated_bytes`` and whose body is a few bytes."""
    return _uvarint(inflated_bytes) + b"\x00" * 8


def _uvarint(n: int) -> bytes:
    """The unsigned LEB128 varint snappy uses for its length prefix (Kafka's record varints zigzag)."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


@functools.cache
def lz4_bomb(inflated_bytes: int = 1 << 30) -> bytes:
    """An LZ4 frame of ``inflated_bytes`` zeros (1 GiB: about 4.5 MB; LZ4 inflates 255-fold at most)."""
    compressor = cramjam.lz4.Compressor(level=0, content_checksum=False, block_linked=False)
    zeros = bytes(MIB)
    for _ in range(inflated_bytes // MIB):
        compressor.compress(zeros)
    return bytes(compressor.finish())


@functools.cache
def zstd_bomb(inflated_bytes: int = 1 << 30) -> bytes:
    """A zstd frame of ``inflated_bytes`` zeros (1 GiB: 32 KB) in RLE blocks of 128 KiB (4 bytes each),
    not declaring its size, and asking for the largest window libzstd accepts by default (128 MiB)."""
    frame_header = struct.pack("<I", 0xFD2FB528) + b"\x00" + bytes([(27 - 10) << 3])  # window 2**27
    blocks = [zstd_rle_block(128 << 10, last=False)] * (inflated_bytes // (128 << 10) - 1)
    return frame_header + b"".join(blocks) + zstd_rle_block(128 << 10, last=True)


def zstd_rle_block(size: int, last: bool) -> bytes:
    """A zstd RLE block (RFC 8878 3.1.1.2): ``size`` zero bytes in 4 bytes."""
    return (size << 3 | 1 << 1 | last).to_bytes(3, "little") + b"\x00"


BOMBS = {GZIP: gzip_bomb, SNAPPY: snappy_bomb, LZ4: lz4_bomb, ZSTD: zstd_bomb}
