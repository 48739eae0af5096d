"""RecordBatch v2: batch headers, validation and control markers, and whole records: built and read
by the client, checked by the broker before it stores a produced batch.

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

Whole records::

    data = record_batch([(ts, b"key", b"value", [("h", b"x")])], compression=COMPRESSION_ZSTD)
    records = decode_batch_records(fetched_batch)   # [Record(offset, timestamp_ms, key, value, headers)]
    check_batch_records(inflate_batch(produced_batch))   # the same checks, without building the records

Both walk the records with aiokafka's record reader (C, about 0.1 us a record) and check that the
header's record count matches the records, each record's length matches its fields, the records
end exactly at the batch's end and their offset deltas run 0..n-1. A compressed batch (gzip,
snappy, lz4, zstd: twophase.wire.compression) is inflated up to ``max_inflated_bytes`` (default
64 MiB): a 1 MB batch that would inflate to 1 GiB costs about that much memory at most, then raises
MessageTooLargeError. The reader builds each record's key and value: checking costs about what
decoding does.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

import crc32c
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatch as _RecordReader
from aiokafka.record.default_records import DefaultRecordBatchBuilder as _BatchBuilder

from .compression import CODEC_NAMES, COMPRESSION_NONE, Buffer, compress, inflate
from .errors import CorruptRecordError, InvalidRecordError
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
_CRC = struct.Struct(">I")
_CRC_AT = 17
_CRC_START = 21
_ATTRIBUTES = struct.Struct(">h")  # at _CRC_START: the CRC covers them and what follows
_PRODUCER = struct.Struct(">qhi")  # producerId, producerEpoch, baseSequence
_PRODUCER_AT = 43
_NO_SIZE_LIMIT = 1 << 62  # record_batch's caller bounds a batch; the builder must take every record
_CONTROL_KEY = struct.Struct(">hh")
_CONTROL_VALUE = struct.Struct(">hi")


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
    _set_crc(buf)
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
    """A v2 batch (base offset 0) of (timestamp_ms, key, value, headers) records, compressed with
    ``compression`` (a codec id of twophase.wire.compression)."""
    return seal_batch(unsealed_batch(records, compression), producer_id=producer_id, producer_epoch=producer_epoch,
                      base_sequence=base_sequence, transactional=transactional)


def unsealed_batch(
    records: Sequence[tuple[int, bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]],
    compression: int = COMPRESSION_NONE,
) -> bytearray:
    """The costly part of :func:`record_batch`: the records encoded (and compressed), before the producer
    id, epoch, sequence and transactional flag are known. A producer builds it ahead, while the round trip
    of the batch before it runs; :func:`seal_batch` sets those fields and the CRC."""
    if not records:
        raise ValueError("a record batch needs at least one record")
    if compression not in CODEC_NAMES.values():
        raise ValueError(f"unknown compression codec {compression}")
    # aiokafka's builder (C) encodes a record in about 0.3 us where Python took 2.4, byte for byte as
    # Kafka does; it builds the batch uncompressed, and cramjam compresses its records below.
    builder = _BatchBuilder(MAGIC, COMPRESSION_NONE, 0, NO_PRODUCER_ID, -1, NO_SEQUENCE, _NO_SIZE_LIMIT)
    for offset_delta, (timestamp_ms, key, value, headers) in enumerate(records):
        # It takes exactly a list of (str, bytes | None) tuples: a caller's bytearray or list pair is converted.
        builder.append(offset_delta, timestamp_ms, key, value,
                       [(str(name), None if data is None else bytes(data)) for name, data in headers])
    built = builder.build()
    if compression == COMPRESSION_NONE:
        return built
    fields = list(_HEADER.unpack_from(built))
    body = compress(compression, bytes(built[HEADER_SIZE:]))
    fields[1] = HEADER_SIZE - LOG_OVERHEAD + len(body)   # batch length
    fields[5] = compression  # attributes
    buf = bytearray(_HEADER.pack(*fields))
    buf += body
    return buf


def seal_batch(batch: bytearray, *, producer_id: int = NO_PRODUCER_ID, producer_epoch: int = -1,
               base_sequence: int = NO_SEQUENCE, transactional: bool = False) -> bytes:
    """The finished batch of an :func:`unsealed_batch` (which it changes; seal it again for other values)."""
    attributes = _ATTRIBUTES.unpack_from(batch, _CRC_START)[0] & ~ATTR_TRANSACTIONAL
    _ATTRIBUTES.pack_into(batch, _CRC_START, attributes | (ATTR_TRANSACTIONAL if transactional else 0))
    _PRODUCER.pack_into(batch, _PRODUCER_AT, producer_id, producer_epoch, base_sequence)
    _set_crc(batch)
    return bytes(batch)


def _set_crc(batch: bytearray) -> None:
    """Write the CRC-32C of everything after it (the batch starts ``batch``)."""
    _CRC.pack_into(batch, _CRC_AT, crc32c.crc32c(memoryview(batch)[_CRC_START:]))


# Most a compressed batch may inflate to, by default: real batches are far smaller (producers cap a
# batch at about 1 MiB before compression), and a bomb stops here.
DEFAULT_MAX_INFLATED_BYTES = 64 * 1024 * 1024
_ATTRIBUTES_LOW_BYTE = 22  # attributes i16 @21, big-endian: the codec bits are in this byte
_T = TypeVar("_T")


def inflate_batch(batch: Buffer, max_inflated_bytes: int = DEFAULT_MAX_INFLATED_BYTES) -> Buffer:
    """The batch that starts ``batch`` with its records uncompressed: ``batch`` itself if they are not
    compressed, else a copy with the records inflated, the codec bits cleared and the length set (the
    CRC is not recomputed). Raises CorruptRecordError for data that does not inflate or an unknown
    codec, MessageTooLargeError for more than ``max_inflated_bytes`` of it (twophase.wire.compression).
    """
    header = parse_header(batch)
    if header.compression == COMPRESSION_NONE:
        return batch
    out = inflate(header.compression, memoryview(batch)[:HEADER_SIZE], memoryview(batch)[HEADER_SIZE : header.size],
                  max_inflated_bytes)
    out[_ATTRIBUTES_LOW_BYTE] &= ~ATTR_COMPRESSION_MASK
    struct.pack_into(">i", out, 8, len(out) - LOG_OVERHEAD)
    return out


def _read_records(batch: Buffer, convert: Callable[[object], _T]) -> list[_T]:
    """``convert`` applied to each record of the uncompressed batch that starts ``batch``, checked as the
    module says."""
    header = parse_header(batch)
    if header.compression != COMPRESSION_NONE:
        raise ValueError("compressed records: inflate_batch first")
    # The reader takes its end from the buffer: exactly the batch. It may read one byte past a
    # record field that runs to the end: that is the next batch, or the terminating NUL byte that
    # bytes and bytearray objects keep after their data.
    reader = _RecordReader(memoryview(batch)[: header.size])
    try:
        records = list(map(convert, reader))
    except (CorruptRecordException, UnicodeDecodeError) as exc:
        raise InvalidRecordError(f"malformed records: {exc}") from None
    except (OverflowError, MemoryError):  # a field length near 2**63: the reader asks for that many bytes
        raise InvalidRecordError("malformed records: a field length is out of range") from None
    return records


def _check_offsets(header: BatchHeader, offsets: list[int]) -> None:
    if offsets != list(range(header.base_offset, header.base_offset + len(offsets))):
        raise InvalidRecordError(f"record offset deltas are not 0..{len(offsets) - 1} in order")


_OFFSET = attrgetter("offset")


def check_batch_records(batch: Buffer) -> None:
    """Check the records of the uncompressed batch that starts ``batch`` (see :func:`inflate_batch`);
    its CRC is not checked here. Raises InvalidRecordError for records that do not parse as the module
    says.
    """
    _check_offsets(parse_header(batch), _read_records(batch, _OFFSET))


def _record(r) -> Record:
    timestamp = r.timestamp
    return Record(r.offset, -1 if timestamp is None else timestamp, r.key, r.value, tuple(r.headers))


def decode_batch_records(batch: Buffer, max_inflated_bytes: int = DEFAULT_MAX_INFLATED_BYTES) -> list[Record]:
    """The records of one complete batch (``batch`` starts at its first byte), inflated if compressed.

    Raises what :func:`inflate_batch` and :func:`check_batch_records` raise.
    """
    data = inflate_batch(batch, max_inflated_bytes)
    records = _read_records(data, _record)
    _check_offsets(parse_header(data), [r.offset for r in records])
    return records
