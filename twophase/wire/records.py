"""RecordBatch v2: batch headers, validation and control markers (the broker never decodes records on
the produce path), and whole records for the client.

The 61-byte header (big-endian)::

    baseOffset i64 @0 | batchLength i32 @8 | partitionLeaderEpoch i32 @12 | magic i8 @16
    crc u32 @17 (CRC-32C over bytes [21:]) | attributes i16 @21 | lastOffsetDelta i32 @23
    baseTimestamp i64 @27 | maxTimestamp i64 @35 | producerId i64 @43 | producerEpoch i16 @51
    baseSequence i32 @53 | recordCount i32 @57

Example::

    buf = bytearray(produce_records)
    for pos, header in iter_batches(buf):          # validates magic, length and CRC
        set_base_offset(buf, pos, next_offset)      # outside the CRC: no re-checksum
        next_offset += header.last_offset_delta + 1
    marker = control_batch(producer_id=7, producer_epoch=0, commit=True,
                           coordinator_epoch=0, timestamp_ms=now_ms)

The client (twophase.client) also builds and reads whole records::

    data = record_batch([(ts, b"key", b"value", [("h", b"x")])], compression=COMPRESSION_GZIP)
    records = decode_batch_records(fetched_batch)   # [Record(offset, timestamp_ms, key, value, headers)]
"""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import crc32c

from .errors import CorruptRecordError
from .varint import decode_varint, encode_varint

HEADER_SIZE = 61
LOG_OVERHEAD = 12  # baseOffset and batchLength precede the bytes that batchLength counts
MAGIC = 2
NO_PRODUCER_ID = -1
NO_SEQUENCE = -1
NO_PARTITION_LEADER_EPOCH = -1
INT32_MAX = 2**31 - 1

ATTR_COMPRESSION_MASK = 0x07
ATTR_LOG_APPEND_TIME = 0x08
ATTR_TRANSACTIONAL = 0x10
ATTR_CONTROL = 0x20

CONTROL_ABORT = 0
CONTROL_COMMIT = 1

_HEADER = struct.Struct(">qiibIhiqqqhii")
_PREFIX = struct.Struct(">qi")  # baseOffset, batchLength
_OFFSET_AND_EPOCH = struct.Struct(">qii")  # baseOffset, batchLength, partitionLeaderEpoch
_CRC_START = 21
_CONTROL_KEY = struct.Struct(">hh")
_CONTROL_VALUE = struct.Struct(">hi")

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class BatchHeader:
    """The 61-byte header of one RecordBatch v2, decoded; what storage needs without the records."""

    base_offset: int
    length: int
    leader_epoch: int
    magic: int
    crc: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    record_count: int

    @property
    def size(self) -> int:
        """Bytes the batch occupies on disk and on the wire."""
        return LOG_OVERHEAD + self.length

    @property
    def last_offset(self) -> int:
        """The offset of the batch's last record."""
        return self.base_offset + self.last_offset_delta

    @property
    def compression(self) -> int:
        """The compression codec bits of the attributes (0: none)."""
        return self.attributes & ATTR_COMPRESSION_MASK

    @property
    def is_transactional(self) -> bool:
        """Whether the batch belongs to a transaction."""
        return bool(self.attributes & ATTR_TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        """Whether the batch is a control batch (a commit or abort marker)."""
        return bool(self.attributes & ATTR_CONTROL)

    @property
    def has_log_append_time(self) -> bool:
        """Whether the timestamps are the broker's append time rather than the producer's."""
        return bool(self.attributes & ATTR_LOG_APPEND_TIME)

    @property
    def has_producer_id(self) -> bool:
        """Whether an (idempotent or transactional) producer id is set."""
        return self.producer_id >= 0

    @property
    def last_sequence(self) -> int:
        """Sequence of the batch's last record; sequences wrap from INT32_MAX to 0."""
        if self.base_sequence < 0:
            return NO_SEQUENCE
        return (self.base_sequence + self.last_offset_delta) % (INT32_MAX + 1)


def parse_header(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Decode the header at ``pos`` without validating it (``buf`` needs 61 bytes there)."""
    if len(buf) - pos < HEADER_SIZE:
        raise CorruptRecordError("truncated batch header", pos)
    return BatchHeader(*_HEADER.unpack_from(buf, pos))


def validate_batch(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Check the batch at ``pos``: complete header, sane length, magic 2 and CRC-32C."""
    remaining = len(buf) - pos
    if remaining < LOG_OVERHEAD:
        raise CorruptRecordError(f"truncated batch: {remaining} bytes left", pos)
    _, length = _PREFIX.unpack_from(buf, pos)
    if length < HEADER_SIZE - LOG_OVERHEAD:
        raise CorruptRecordError(f"batch length {length} shorter than a v2 header", pos)
    if LOG_OVERHEAD + length > remaining:
        raise CorruptRecordError(f"batch length {length} exceeds the {remaining - LOG_OVERHEAD} bytes present", pos)
    header = parse_header(buf, pos)
    if header.magic != MAGIC:
        raise CorruptRecordError(f"unsupported magic {header.magic} (only RecordBatch v2)", pos)
    actual = crc32c.crc32c(memoryview(buf)[pos + _CRC_START : pos + LOG_OVERHEAD + length])
    if actual != header.crc:
        raise CorruptRecordError(f"CRC mismatch: stored {header.crc:#010x}, computed {actual:#010x}", pos)
    return header


def iter_batches(buf: Buffer, *, validate: bool = True) -> Iterator[tuple[int, BatchHeader]]:
    """Yield (position, header) for each batch in ``buf``; raises CorruptRecordError at the first bad one.

    With ``validate=False`` only framing is checked (no magic/CRC): for bytes already validated.
    """
    pos = 0
    end = len(buf)
    while pos < end:
        if validate:
            header = validate_batch(buf, pos)
        else:
            header = parse_header(buf, pos)
            if header.length < HEADER_SIZE - LOG_OVERHEAD or pos + header.size > end:
                raise CorruptRecordError(f"bad batch length {header.length}", pos)
        yield pos, header
        pos += header.size


def set_base_offset(buf: bytearray | memoryview, pos: int, base_offset: int, leader_epoch: int | None = None) -> None:
    """Rewrite baseOffset (and partitionLeaderEpoch) in place; both lie outside the CRC."""
    struct.pack_into(">q", buf, pos, base_offset)
    if leader_epoch is not None:
        struct.pack_into(">i", buf, pos + 12, leader_epoch)


def control_batch(
    producer_id: int, producer_epoch: int, commit: bool, coordinator_epoch: int, timestamp_ms: int
) -> bytes:
    """A valid v2 control batch holding one commit or abort marker (base offset 0, to be assigned)."""
    key = _CONTROL_KEY.pack(0, CONTROL_COMMIT if commit else CONTROL_ABORT)
    value = _CONTROL_VALUE.pack(0, coordinator_epoch)
    records = encode_record(0, 0, key, value)
    length = HEADER_SIZE - LOG_OVERHEAD + len(records)
    buf = bytearray(
        _HEADER.pack(
            0, length, NO_PARTITION_LEADER_EPOCH, MAGIC, 0, ATTR_TRANSACTIONAL | ATTR_CONTROL,
            0, timestamp_ms, timestamp_ms, producer_id, producer_epoch, NO_SEQUENCE, 1,
        )
    )
    buf += records
    struct.pack_into(">I", buf, 17, crc32c.crc32c(memoryview(buf)[_CRC_START:]))
    return bytes(buf)


@dataclass(frozen=True)
class ControlRecord:
    """The marker a control batch holds: the transaction committed or aborted, by which coordinator epoch."""

    commit: bool
    coordinator_epoch: int


@dataclass(frozen=True)
class _RecordView:
    timestamp_delta: int
    offset_delta: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    end: int


def _read_bytes(buf: Buffer, pos: int, end: int) -> tuple[bytes | None, int]:
    n, pos = decode_varint(buf, pos)
    if n < 0:
        return None, pos
    if pos + n > end:
        raise ValueError("record field out of bounds")
    return bytes(buf[pos : pos + n]), pos + n


def _read_record(buf: Buffer, pos: int) -> _RecordView:
    """One v2 record starting at ``pos``; ValueError if it does not fit in ``buf``."""
    length, pos = decode_varint(buf, pos)
    end = pos + length
    if length < 0 or end > len(buf):
        raise ValueError("record length out of bounds")
    pos += 1  # attributes, unused in v2
    ts_delta, pos = decode_varint(buf, pos)
    offset_delta, pos = decode_varint(buf, pos)
    key, pos = _read_bytes(buf, pos, end)
    value, pos = _read_bytes(buf, pos, end)
    count, pos = decode_varint(buf, pos)
    headers = []
    for _ in range(count):
        name, pos = _read_bytes(buf, pos, end)
        header_value, pos = _read_bytes(buf, pos, end)
        headers.append(((name or b"").decode("utf-8", "replace"), header_value))
    return _RecordView(ts_delta, offset_delta, key, value, tuple(headers), end)


def parse_control_record(batch: Buffer) -> ControlRecord:
    """Decode the marker of a control batch (``batch`` starts at the batch's first byte)."""
    header = parse_header(batch)
    if not header.is_control or header.record_count < 1:
        raise CorruptRecordError("not a control batch")
    try:
        record = _read_record(batch, HEADER_SIZE)
        if record.key is None or record.value is None or len(record.key) < 4 or len(record.value) < 6:
            raise ValueError("control record key/value too short")
        _, kind = _CONTROL_KEY.unpack_from(record.key)
        _, coordinator_epoch = _CONTROL_VALUE.unpack_from(record.value)
    except (ValueError, struct.error) as exc:
        raise CorruptRecordError(f"malformed control record: {exc}") from None
    if kind not in (CONTROL_ABORT, CONTROL_COMMIT):
        raise CorruptRecordError(f"unknown control record type {kind}")
    return ControlRecord(commit=kind == CONTROL_COMMIT, coordinator_epoch=coordinator_epoch)


def iter_record_timestamps(batch: Buffer) -> Iterator[tuple[int, int]]:
    """Yield (offset, timestamp) of each record of an uncompressed batch (``batch`` starts at its first byte).

    Compressed batches raise ValueError: callers fall back to batch-level timestamps.
    """
    header = parse_header(batch)
    if header.has_log_append_time:
        for delta in range(header.last_offset_delta + 1):
            yield header.base_offset + delta, header.max_timestamp
        return
    if header.compression:
        raise ValueError("compressed batch")
    pos = HEADER_SIZE
    end = header.size
    for _ in range(header.record_count):
        if pos >= end:
            raise ValueError("record count exceeds batch")
        record = _read_record(memoryview(batch)[:end], pos)
        yield header.base_offset + record.offset_delta, header.base_timestamp + record.timestamp_delta
        pos = record.end


# --- whole records, for clients (twophase.client): encoding with headers, decoding fetched batches ---

COMPRESSION_NONE = 0
COMPRESSION_GZIP = 1


@dataclass(frozen=True)
class Record:
    """One decoded record of a fetched batch."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]


def _varbytes(data: bytes | None) -> bytes:
    return encode_varint(-1) if data is None else encode_varint(len(data)) + data


def encode_record(offset_delta: int, timestamp_delta: int, key: bytes | None, value: bytes | None,
                  headers: Sequence[tuple[str, bytes | None]] = ()) -> bytes:
    """One length-prefixed v2 record (attributes 0)."""
    body = bytearray(b"\x00")
    body += encode_varint(timestamp_delta) + encode_varint(offset_delta) + _varbytes(key) + _varbytes(value)
    body += encode_varint(len(headers))
    for name, header_value in headers:
        body += _varbytes(name.encode()) + _varbytes(header_value)
    return encode_varint(len(body)) + bytes(body)


def record_batch(
    records: Sequence[tuple[int, bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]],
    *, producer_id: int = NO_PRODUCER_ID, producer_epoch: int = -1, base_sequence: int = NO_SEQUENCE,
    transactional: bool = False, compression: int = COMPRESSION_NONE,
) -> bytes:
    """A v2 batch (base offset 0) of (timestamp_ms, key, value, headers) records, optionally gzipped."""
    if not records:
        raise ValueError("a record batch needs at least one record")
    if compression not in (COMPRESSION_NONE, COMPRESSION_GZIP):
        raise ValueError(f"unsupported compression codec {compression} (only none and gzip)")
    base_ts = records[0][0]
    body = b"".join(encode_record(i, ts - base_ts, key, value, headers)
                    for i, (ts, key, value, headers) in enumerate(records))
    if compression == COMPRESSION_GZIP:
        body = gzip.compress(body, compresslevel=6, mtime=0)
    attributes = compression | (ATTR_TRANSACTIONAL if transactional else 0)
    buf = bytearray(_HEADER.pack(
        0, HEADER_SIZE - LOG_OVERHEAD + len(body), NO_PARTITION_LEADER_EPOCH, MAGIC, 0, attributes,
        len(records) - 1, base_ts, max(r[0] for r in records), producer_id, producer_epoch, base_sequence,
        len(records)))
    buf += body
    struct.pack_into(">I", buf, 17, crc32c.crc32c(memoryview(buf)[_CRC_START:]))
    return bytes(buf)


def _decode_records(body: Buffer, header: BatchHeader) -> Iterator[Record]:
    pos = 0
    for _ in range(header.record_count):
        record = _read_record(body, pos)
        timestamp = header.max_timestamp if header.has_log_append_time else header.base_timestamp + record.timestamp_delta
        yield Record(header.base_offset + record.offset_delta, timestamp, record.key, record.value, record.headers)
        pos = record.end


def decode_batch_records(batch: Buffer) -> list[Record]:
    """The records of one complete batch (``batch`` starts at its first byte); gzip is decompressed.

    Raises CorruptRecordError for other codecs or malformed records.
    """
    header = parse_header(batch)
    body = memoryview(batch)[HEADER_SIZE : header.size]
    if header.compression == COMPRESSION_GZIP:
        try:
            body = memoryview(gzip.decompress(body))
        except (OSError, EOFError, zlib.error) as exc:
            raise CorruptRecordError(f"bad gzip data: {exc}") from None
    elif header.compression != COMPRESSION_NONE:
        raise CorruptRecordError(f"compression codec {header.compression} is not supported (only none and gzip)")
    try:
        return list(_decode_records(body, header))
    except ValueError as exc:
        raise CorruptRecordError(f"malformed record: {exc}") from None
