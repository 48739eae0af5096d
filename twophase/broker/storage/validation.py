"""The records of a produced batch, checked before storage sees them (Kafka's LogValidator).

Storage checks each batch's framing, magic, CRC-32C and header (record count against the last
offset delta, no control batch from a client, producer id and sequence). This checks what the
header describes: the records themselves (twophase.wire.records.check_batch_records), so that a
batch no client could read is refused instead of stored. What a refusal answers:

- INVALID_RECORD (87): records that do not parse: a record count that disagrees with the records,
  a record whose length disagrees with its fields, bytes left after the last record, offset
  deltas other than 0..n-1, a header key that is not UTF-8.
- CORRUPT_MESSAGE (2): a batch whose CRC does not match (whatever else is wrong with it, as in
  Kafka, which checks the CRC first), compressed data that does not inflate (gzip, snappy, lz4,
  zstd), an unknown codec id.
- MESSAGE_TOO_LARGE (10): compressed batches inflating to more than 64 MiB in one request, all
  partitions together (``REQUEST_INFLATION_LIMIT``). Inflating stops there, so a bomb of any codec
  costs about that much memory and event-loop time at most, per request: about what checking 64 MiB
  of uncompressed records costs. A Java producer answered this splits the batch and sends the halves.
- INVALID_TIMESTAMP (32): the LogAppendTime timestamp type set by a producer.

Batches of every codec are inflated (twophase.wire.compression) and their records checked, and
stored compressed as sent. A batch's maxTimestamp is stored as sent.

Example::

    budget = InflationBudget()                       # one per Produce request
    try:
        validate_records(partition_data.records, budget)
    except KafkaError as exc:
        answer(exc.code, str(exc))
"""

from __future__ import annotations

from dataclasses import dataclass

from kio.schema.errors import ErrorCode

from twophase.wire.compression import most_inflated
from twophase.wire.errors import CorruptRecordError, KafkaError, MessageTooLargeError
from twophase.wire.records import (
    DEFAULT_MAX_INFLATED_BYTES,
    HEADER_SIZE,
    MAGIC,
    BatchHeader,
    Buffer,
    check_batch_records,
    inflate_batch,
    iter_batches,
    validate_batch,
)

REQUEST_INFLATION_LIMIT = DEFAULT_MAX_INFLATED_BYTES


@dataclass
class InflationBudget:
    """What the compressed batches of one Produce request may still inflate to, all partitions together.

    Example::

        budget = InflationBudget()
        validate_records(records_of_partition_0, budget)
        validate_records(records_of_partition_1, budget)     # what partition 0 inflated counts here
    """

    remaining: int = REQUEST_INFLATION_LIMIT


def validate_records(records: Buffer, budget: InflationBudget) -> None:
    """Check the records of every batch in one partition's ``records`` of a Produce, inflating at most
    what ``budget`` allows (and taking it from the budget, whatever the outcome). Raises KafkaError
    with the code to answer.
    """
    view = memoryview(records)
    for pos, header in iter_batches(view, validate=False):
        try:
            _validate(view[pos : pos + header.size], header, budget)
        except KafkaError:
            validate_batch(view, pos)  # raises CORRUPT_MESSAGE for a bad magic or CRC first
            raise


def _validate(batch: memoryview, header: BatchHeader, budget: InflationBudget) -> None:
    if header.magic != MAGIC:
        raise CorruptRecordError(f"unsupported magic {header.magic} (only RecordBatch v2)")
    if header.has_log_append_time:
        raise KafkaError("a producer may not set the LogAppendTime timestamp type", ErrorCode.invalid_timestamp)
    try:
        data = inflate_batch(batch, budget.remaining)
    except MessageTooLargeError:
        budget.remaining = 0  # it inflated all that was left
        raise MessageTooLargeError(
            f"compressed records of this request inflate to more than {REQUEST_INFLATION_LIMIT} bytes") from None
    except CorruptRecordError:
        # Damaged after inflating an unknown amount: charge the most the codec can have produced, so
        # that bombs with a broken tail cannot each inflate a whole budget.
        budget.remaining -= min(budget.remaining, most_inflated(header.compression, len(batch) - HEADER_SIZE))
        raise
    if data is not batch:
        budget.remaining -= len(data) - HEADER_SIZE
    check_batch_records(data)
