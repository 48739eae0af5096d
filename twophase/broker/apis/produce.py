"""Produce (key 0), v3-v9: append RecordBatch v2 bytes to partition logs.

The records are checked (twophase.broker.storage.validation: a batch no client could read is
refused) and handed to storage as they are: it validates each batch (CRC-32C, magic,
idempotent-producer sequence) and assigns offsets. A retried idempotent batch is acknowledged
with its original offset. acks must be 0, 1 or -1; with acks=0
no response is sent. Unknown topics are created when the broker auto-creates topics, off the event
loop (the request waits; LEADER_NOT_AVAILABLE while another request creates the same name). Under fsync
"always" a response waits until its batches are fsynced; that fsync runs off the event loop and is
shared with every other append made before it started (twophase.broker.group_commit).

A transactional batch needs the request's transactional id (INVALID_RECORD without one), and a
request with a transactional id must carry transactional batches (INVALID_RECORD otherwise)
of the transaction's current producer id and epoch (INVALID_PRODUCER_EPOCH for a fenced one),
for a partition added to the open transaction (INVALID_TXN_STATE otherwise): data the
coordinator does not know about would hold back the last stable offset forever. A batch without a
transactional id may only carry a producer id InitProducerId issued for idempotence:
UNKNOWN_PRODUCER_ID for an id never issued, INVALID_PRODUCER_ID_MAPPING for a transactional id's.
Producer ids are sequential: without this check a client could claim the next one with a high epoch
and fence the transactional producer that gets it. An idempotent id's epoch is not checked: the Java
producer bumps it itself (KIP-360), and a bump fences only that id's own producer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import CorruptRecordError, KafkaError
from twophase.wire.records import iter_batches

from ..protocol import handles
from ..storage.validation import InflationBudget, validate_records
from ..txn.coordinator import NOT_ENOUGH_REPLICAS
from ._common import NO_THROTTLE, NONE, error

log = logging.getLogger("twophase.broker")


@handles(ApiKey.PRODUCE, 3, 9)  # 3: RecordBatch v2 and idempotence
async def handle(broker, request):
    """Answer Produce: append each partition's batches and answer once they are durable; None for acks=0."""
    body, rt = request.body, request.response_type()
    TopicResponse, PartitionResponse = nested(rt, "TopicProduceResponse"), nested(rt, "PartitionProduceResponse")
    acks = body.acks
    now_ms = int(time.time() * 1000)
    inflation = InflationBudget()  # what the request's compressed batches may inflate to, in total

    def partition_response(index, code, base_offset=-1, append_time=-1, log_start=-1, message=None):
        return build(PartitionResponse, index=index, error_code=code, base_offset=base_offset,
                     log_append_time=(datetime.fromtimestamp(append_time / 1000, timezone.utc)
                                      if append_time >= 0 else None),
                     log_start_offset=log_start, record_errors=(), error_message=message)

    async def appended(topic: str, index: int, plog, result):
        """The response for batches appended (or found to be a retry): sent once they are durable."""
        def wake_readers() -> None:
            broker.data_arrived(topic, index)

        try:
            await broker.group_commit.durable(plog, result.last_offset + 1, wake_readers)
        except KafkaError as exc:
            return partition_response(index, error(exc.code), message=str(exc)[:200])
        if not result.duplicate:
            wake_readers()  # visible without an fsync (an interval policy) or already woken by it
        return partition_response(index, NONE, result.base_offset, result.log_append_time, plog.log_start_offset)

    topics = []
    for topic in body.topic_data:
        partitions = []
        refused = await _auto_create(broker, topic.name)
        for part in topic.partition_data:
            if acks not in (0, 1, -1):
                partitions.append(partition_response(part.index, ErrorCode.invalid_required_acks))
                continue
            if refused is not None:
                partitions.append(partition_response(part.index, error(refused.code), message=str(refused)[:200]))
                continue
            if not part.records:
                partitions.append(partition_response(part.index, ErrorCode.invalid_record, message="no records"))
                continue
            if body.transactional_id is not None:
                # No await from here to the append: the transaction log's record of the partition in the
                # transaction is durable before its data lands (AddPartitionsToTxn is answered before its fsync).
                await broker.transactions.additions_durable(body.transactional_id)
            refusal = _transaction_check(broker, body.transactional_id, topic.name, part.index, part.records)
            if refusal is not None:
                partitions.append(partition_response(part.index, refusal[0], message=refusal[1]))
                continue
            try:
                validate_records(part.records, inflation)  # what storage does not check: the records
                plog = broker.partition_log(topic.name, part.index)
                # Under fsync "always" the fsync is shared with other requests (group commit); acks=0
                # has no response to hold back, so it syncs inline.
                result = plog.append(part.records, now_ms, defer_fsync=acks != 0)
            except KafkaError as exc:
                if exc.code not in (3, 45, 47):  # routine for clients; the rest is worth a look
                    log.info("produce to %r partition %d from %s refused: %s", topic.name, part.index, request.peer, exc)
                partitions.append(partition_response(part.index, error(exc.code), message=str(exc)[:200]))
                continue
            partitions.append(appended(topic.name, part.index, plog, result))
        topics.append((topic.name, partitions))
    pending = [p for _, partitions in topics for p in partitions if asyncio.iscoroutine(p)]
    done = iter(await asyncio.gather(*pending))
    topics = [build(TopicResponse, name=name, partition_responses=tuple(
        next(done) if asyncio.iscoroutine(p) else p for p in partitions)) for name, partitions in topics]
    if acks == 0:
        return None
    return build(rt, responses=tuple(topics), throttle_time=NO_THROTTLE)


async def _auto_create(broker, topic: str) -> KafkaError | None:
    """Create ``topic`` if it is new and the broker auto-creates topics (off the event loop, so
    other clients are served meanwhile); the KafkaError that refused it, else None."""
    if not broker.config.auto_create_topics or broker.has_topic(topic):
        return None
    try:
        await broker.auto_create_topic(topic)
    except KafkaError as exc:
        log.info("auto-creating topic %r for a produce failed: %s", topic, exc)
        return exc
    return None


def _transaction_check(broker, transactional_id: str | None, topic: str, partition: int, records: bytes):
    """(error, message) if these batches may not be appended (to the transaction), else None."""
    try:
        headers = [header for _, header in iter_batches(records, validate=False)]
    except CorruptRecordError:
        return None  # storage rejects it with the precise error
    for header in headers:
        if transactional_id is None:
            if header.is_transactional:
                return ErrorCode.invalid_record, "a transactional batch without a transactional id"
            if header.has_producer_id and (code := broker.transactions.check_idempotent_produce(
                    header.producer_id, header.producer_epoch)):
                return error(code), (f"producer id {header.producer_id} epoch {header.producer_epoch} "
                                     "was not issued to an idempotent producer")
            continue
        if not header.is_transactional:
            return ErrorCode.invalid_record, "a transactional producer sent a non-transactional batch"
        code = broker.transactions.check_produce(transactional_id, header.producer_id, header.producer_epoch,
                                                 topic, partition)
        if code == NOT_ENOUGH_REPLICAS:
            return error(code), "the transaction log is unavailable until the broker restarts"
        if code:
            return error(code), f"not part of the open transaction of {transactional_id!r}"
    return None
