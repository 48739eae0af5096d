"""The compression codecs of RecordBatch v2 (the attributes' low 3 bits): compress a batch's records,
and inflate them with a bound. Client and broker both use this table; nothing else inflates.

=====  ======  =========================================================================================
 id    name    written here (as Kafka's Java client writes it), and what is read
=====  ======  =========================================================================================
 0     none    the records as they are
 1     gzip    one gzip member (RFC 1952), level 6; several concatenated members are read too
 2     snappy  snappy-java's framing: b"\\x82SNAPPY\\x00", version 1, compatible version 1 (int32
               big-endian each), then blocks of [int32 big-endian length][raw snappy] of 32 KiB
               each. Raw snappy (what librdkafka writes) is read too: a payload is framed if it starts
               with the magic (as librdkafka and kafka-python tell).
 3     lz4     an LZ4 frame with independent 64 KiB blocks (Kafka's Java reader refuses dependent
               blocks), block checksums, a correct header checksum (only magic 0 had the broken
               one), LZ4's fast mode; any LZ4 frame is read
 4     zstd    one zstd frame (RFC 8878), level 3, declaring its size; one or more frames are read
=====  ======  =========================================================================================

Inflating is bounded: :func:`inflate` refuses, with MessageTooLargeError, records that inflate to
more than ``max_bytes``, holding about ``max_bytes`` inflated bytes at most whatever the data
declares, and raises CorruptRecordError for data that does not inflate. How each codec keeps that:

- gzip: zlib inflates in 1 MiB steps (``max_length``) until the bound.
- snappy: each raw block declares its length (a varint): the declarations are added up and checked
  against the bound, and each against what its block's bytes can hold (21 times their length),
  before anything is allocated; each block then inflates into exactly its declared room.
- lz4 and zstd: a frame need not declare its size (Kafka's Java producer never does) and a
  declaration is not trusted: the data is inflated into a buffer of a guessed size (8 times the
  compressed size, at least 256 KiB), and if it does not fit, again into one 4 times as large, up to
  ``max_bytes`` + 1 (librdkafka's zstd reader does the same). The decoders' own state is a constant
  beside that: lz4's block buffers (4 MiB at most), zstd's window (128 MiB at most, libzstd's default
  limit; written only as far as the data inflates).

cramjam (Rust bindings of snap, lz4 and zstd) does the codec work; zlib does gzip.

Example::

    codec = codec_id("zstd")                              # ValueError for an unknown name
    payload = compress(codec, records)
    batch = inflate(codec, header, payload, max_bytes=64 << 20)   # header + the inflated records
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import cramjam

from .errors import CorruptRecordError, MessageTooLargeError

Buffer = bytes | bytearray | memoryview

COMPRESSION_NONE = 0
COMPRESSION_GZIP = 1
COMPRESSION_SNAPPY = 2
COMPRESSION_LZ4 = 3
COMPRESSION_ZSTD = 4

_GZIP_STEP = 1 << 20
_FIRST_GUESS = 256 << 10  # lz4 and zstd: the first buffer tried, at least
_GUESS_RATIO = 8
_GROWTH = 4
# What cramjam raises (Rust's io::ErrorKind::WriteZero) when the decoder has more than the output
# buffer holds: the data goes on, it is not damaged.
_OUTPUT_FULL = "failed to write whole buffer"
_XERIAL_MAGIC = b"\x82SNAPPY\x00"
_XERIAL_HEADER = _XERIAL_MAGIC + (1).to_bytes(4, "big") + (1).to_bytes(4, "big")  # version 1, compatible 1
_XERIAL_BLOCK = 32 << 10  # snappy-java's default block size
_SNAPPY_MAX_RATIO = 22  # a 3-byte copy element writes at most 64 bytes


@dataclass(frozen=True)
class _Codec:
    name: str
    compress: Callable[[Buffer], bytes]
    inflate: Callable[[Buffer, Buffer, int], bytearray]
    max_ratio: int  # the most one compressed byte can inflate to, by the format


def _gzip_compress(data: Buffer) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


def _gzip_inflate(prefix: Buffer, payload: Buffer, max_bytes: int) -> bytearray:
    out = bytearray(prefix)
    limit = len(out) + max_bytes
    data = payload
    try:
        while data:  # one gzip member a round: producers write one, the format allows several
            inflater = zlib.decompressobj(wbits=31)
            while not inflater.eof:
                chunk = inflater.decompress(data, min(_GZIP_STEP, limit + 1 - len(out)))
                data = inflater.unconsumed_tail
                if not chunk and not data:
                    raise CorruptRecordError("truncated gzip data")
                out += chunk
                if len(out) > limit:
                    raise MessageTooLargeError(f"compressed records inflate to more than {max_bytes} bytes")
            data = inflater.unused_data
    except zlib.error as exc:
        raise CorruptRecordError(f"bad gzip data: {exc}") from None
    return out


def _xerial_compress(data: Buffer) -> bytes:
    view = memoryview(data)
    parts = [_XERIAL_HEADER]
    for start in range(0, len(view), _XERIAL_BLOCK):
        block = bytes(cramjam.snappy.compress_raw(view[start : start + _XERIAL_BLOCK]))
        parts += (len(block).to_bytes(4, "big"), block)
    return b"".join(parts)


def _snappy_blocks(payload: Buffer) -> list[memoryview]:
    """The raw snappy blocks of ``payload``: itself, or the blocks of its xerial framing."""
    view = memoryview(payload)
    if view[: len(_XERIAL_MAGIC)] != _XERIAL_MAGIC:
        return [view]
    if len(view) < len(_XERIAL_HEADER):
        raise CorruptRecordError("truncated snappy-java header")
    blocks = []
    pos = len(_XERIAL_HEADER)
    while pos < len(view):
        if pos + 4 > len(view):
            raise CorruptRecordError("truncated snappy-java block length")
        length = int.from_bytes(view[pos : pos + 4], "big")
        pos += 4
        if pos + length > len(view):
            raise CorruptRecordError(f"snappy-java block of {length} bytes exceeds the {len(view) - pos} present")
        blocks.append(view[pos : pos + length])
        pos += length
    return blocks


def _snappy_inflate(prefix: Buffer, payload: Buffer, max_bytes: int) -> bytearray:
    blocks = _snappy_blocks(payload)
    sizes = []
    total = 0
    for block in blocks:
        try:
            size = cramjam.snappy.decompress_raw_len(block)
        except cramjam.DecompressionError as exc:
            raise CorruptRecordError(f"bad snappy data: {exc}") from None
        total += size
        if total > max_bytes:
            raise MessageTooLargeError(f"compressed records inflate to more than {max_bytes} bytes")
        if size > _SNAPPY_MAX_RATIO * len(block):
            raise CorruptRecordError(f"a snappy block of {len(block)} bytes declares {size} bytes inflated")
        sizes.append(size)
    out = bytearray(len(prefix) + total)
    out[: len(prefix)] = prefix
    pos = len(prefix)
    for block, size in zip(blocks, sizes):
        try:
            with memoryview(out)[pos : pos + size] as target:
                cramjam.snappy.decompress_raw_into(block, target)
        except cramjam.DecompressionError as exc:
            raise CorruptRecordError(f"bad snappy data: {exc}") from None
        pos += size
    return out


def _lz4_compress(data: Buffer) -> bytes:
    # Level 0: LZ4's fast mode (Kafka's Java client and librdkafka use it by default; 3 and up is LZ4HC).
    compressor = cramjam.lz4.Compressor(level=0, content_checksum=False, block_linked=False)
    compressor.compress(data)
    return bytes(compressor.finish())


def _zstd_compress(data: Buffer) -> bytes:
    return bytes(cramjam.zstd.compress(data, level=3))  # zstd's default level, as Kafka's


def _growing_inflate(name: str, decompress_into: Callable[[Buffer, memoryview], int]):
    """An inflate for a codec whose frames need not declare their size: see the module docstring."""
    def inflate(prefix: Buffer, payload: Buffer, max_bytes: int) -> bytearray:
        size = min(max_bytes + 1, max(_FIRST_GUESS, _GUESS_RATIO * len(payload)))
        while True:
            out = bytearray(len(prefix) + size)
            out[: len(prefix)] = prefix
            try:
                with memoryview(out)[len(prefix) :] as target:
                    inflated = decompress_into(payload, target)
            except cramjam.DecompressionError as exc:
                if _OUTPUT_FULL not in str(exc):
                    raise CorruptRecordError(f"bad {name} data: {exc}") from None
                inflated = size + 1  # at least: one byte more than the buffer holds
            if inflated > max_bytes:
                raise MessageTooLargeError(f"compressed records inflate to more than {max_bytes} bytes")
            if inflated <= size:
                del out[len(prefix) + inflated :]
                return out
            del out  # before the larger buffer: never two at once
            size = min(max_bytes + 1, size * _GROWTH)

    return inflate


_CODECS = {
    COMPRESSION_GZIP: _Codec("gzip", _gzip_compress, _gzip_inflate, 1032),
    COMPRESSION_SNAPPY: _Codec("snappy", _xerial_compress, _snappy_inflate, _SNAPPY_MAX_RATIO),
    COMPRESSION_LZ4: _Codec("lz4", _lz4_compress, _growing_inflate("lz4", cramjam.lz4.decompress_into), 255),
    # A 4-byte RLE block writes up to 128 KiB.
    COMPRESSION_ZSTD: _Codec("zstd", _zstd_compress, _growing_inflate("zstd", cramjam.zstd.decompress_into),
                             32 << 10),
}
CODEC_NAMES = {"none": COMPRESSION_NONE, **{codec.name: id_ for id_, codec in _CODECS.items()}}


def codec_id(name: str) -> int:
    """The codec id of ``name`` (Kafka's compression.type values: none, gzip, snappy, lz4, zstd).

    Raises ValueError naming the known codecs for any other name.
    """
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown compression codec {name!r}: one of {', '.join(CODEC_NAMES)}")
    return CODEC_NAMES[name]


def _codec(codec: int) -> _Codec:
    if codec not in _CODECS:
        raise CorruptRecordError(f"unknown compression codec {codec}")
    return _CODECS[codec]


def compress(codec: int, data: Buffer) -> bytes:
    """``data`` compressed with ``codec`` (not COMPRESSION_NONE) in the format the module table names."""
    return _codec(codec).compress(data)


def inflate(codec: int, prefix: Buffer, payload: Buffer, max_bytes: int) -> bytearray:
    """A new buffer holding ``prefix`` then ``payload`` inflated with ``codec``.

    Raises MessageTooLargeError if ``payload`` inflates to more than ``max_bytes`` (inflating no
    further) and CorruptRecordError if it does not inflate or ``codec`` is unknown.
    """
    return _codec(codec).inflate(prefix, payload, max_bytes)


def most_inflated(codec: int, compressed_bytes: int) -> int:
    """The most ``compressed_bytes`` of ``codec`` data can inflate to, by the format (0 for an unknown
    codec): what inflating data that turned out damaged may have cost."""
    return _CODECS[codec].max_ratio * compressed_bytes if codec in _CODECS else 0
