"""The records of a produced batch, checked before storage sees them (Kafka's LogValidator).

Storage checks each batch's framing, magic, CRC-32C and header (record count against the last
offset delta, no control batch from a client, producer id and sequence). This checks what the
header describes: the records themselves (twophase.wire.records.check_batch_records), so that a
batch no client could read is refused instead of stored. What a refusal answers:

- INVALID_RECORD (87): records that do not parse: a record count that disagrees with the records,
  a record whose length disagrees with its fields, bytes left after the last record, offset
  deltas other than 0..n-1, a header key that is not UTF-8.
- CORRUPT_MESSAGE (2): a batch whose CRC does not match (whatever else is wrong with it, as in
  Kafka, which checks the CRC first), gzip data that does not inflate, an unknown codec id.
- MESSAGE_TOO_LARGE (10): a compressed batch inflating to more than ``max_inflated_bytes``
  (64 MiB). It stops inflating there, so a bomb costs that much memory at most. A Java producer
  answered this splits the batch and sends the halves.
- INVALID_TIMESTAMP (32): the LogAppendTime timestamp type set by a producer.

gzip batches are inflated and checked; snappy, lz4 and zstd batches (no codec for them here)
are stored after the header and CRC checks alone. A batch's maxTimestamp is stored as sent.

Example::

    try:
        validate_records(partition_data.records)
    except KafkaError as exc:
        answer(exc.code, str(exc))
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.errors import CorruptRecordError, KafkaError
from twophase.wire.records import (
    COMPRESSION_GZIP,
    COMPRESSION_NONE,
    DEFAULT_MAX_INFLATED_BYTES,
    MAGIC,
    BatchHeader,
    Buffer,
    check_batch_records,
    iter_batches,
    validate_batch,
)

_KNOWN_CODECS = range(5)  # none, gzip, snappy, lz4, zstd
_CHECKED_CODECS = (COMPRESSION_NONE, COMPRESSION_GZIP)


def validate_records(records: Buffer, max_inflated_bytes: int = DEFAULT_MAX_INFLATED_BYTES) -> None:
    """Check the records of every batch in a Produce's ``records``; raises KafkaError with the code to answer."""
    view = memoryview(records)
    for pos, header in iter_batches(view, validate=False):
        try:
            _validate(view[pos : pos + header.size], header, max_inflated_bytes)
        except KafkaError:
            validate_batch(view, pos)  # raises CORRUPT_MESSAGE for a bad magic or CRC first
            raise


def _validate(batch: memoryview, header: BatchHeader, max_inflated_bytes: int) -> None:
    if header.magic != MAGIC:
        raise CorruptRecordError(f"unsupported magic {header.magic} (only RecordBatch v2)")
    if header.has_log_append_time:
        raise KafkaError("a producer may not set the LogAppendTime timestamp type", ErrorCode.invalid_timestamp)
    if header.compression not in _KNOWN_CODECS:
        raise CorruptRecordError(f"unknown compression codec {header.compression}")
    if header.compression in _CHECKED_CODECS:
        check_batch_records(batch, max_inflated_bytes)
