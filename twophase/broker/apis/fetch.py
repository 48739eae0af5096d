"""Fetch (key 1), v4-v12, sessionless: read whole record batches from partition logs.

Long poll: when the response would hold fewer than min_bytes, the request is parked until a
produce to one of its partitions wakes it (no polling loop), max_wait expires, or the client
goes away. Fetch sessions (v7+) are not kept: a request to start one gets session id 0 ("no
session"), which clients treat as "send full requests"; an incremental request names a session
we never handed out and gets FETCH_SESSION_ID_NOT_FOUND. Topic ids (v13+) are not advertised.

Isolation: read_committed (isolation_level 1) returns only batches below the last stable offset and
lists the aborted transactions (producer id, first offset) overlapping the returned batches, which the
client uses to drop aborted records; read_uncommitted returns everything up to the high watermark and
no aborted transactions (null). Both report the LSO. A read_committed long poll counts only data below
the LSO, and the marker that moves the LSO wakes it (the coordinator calls ``broker.data_arrived``).

Response size: partition_max_bytes per partition and max_bytes for the whole response, except
that the first partition with data always gets at least one whole batch (KIP-74), so a batch
larger than the limits cannot stall a consumer.
"""

from __future__ import annotations

import asyncio
import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, READ_COMMITTED, error


def _read(broker, body, rt) -> tuple[tuple, int, bool]:
    """(topic responses, bytes of records, whether any partition has an error)."""
    TopicResponse, PartitionData = nested(rt, "FetchableTopicResponse"), nested(rt, "PartitionData")
    AbortedTransaction = nested(rt, "AbortedTransaction")
    committed = body.isolation_level == READ_COMMITTED
    budget = max(0, body.max_bytes)
    total = 0
    errors = False
    topics = []
    for topic in body.topics:
        partitions = []
        for part in topic.partitions:
            try:
                plog = broker.partition_log(topic.topic, part.partition)
                high_watermark = plog.high_watermark
                stable = plog.last_stable_offset
                upper = stable if committed else None
                if total == 0:
                    # Nothing in the response yet: at least one whole batch, even above the limits.
                    records, end = plog.read_range(
                        part.fetch_offset, max(min(part.partition_max_bytes, budget), 1), upper)
                else:
                    records, end = _read_within(
                        plog, part.fetch_offset, min(part.partition_max_bytes, budget - total), upper)
                total += len(records)
                aborted = None
                if committed:
                    aborted = tuple(build(AbortedTransaction, producer_id=pid, first_offset=first)
                                    for pid, first in plog.aborted_transactions(part.fetch_offset, end))
                partitions.append(build(
                    PartitionData, partition_index=part.partition, error_code=NONE, high_watermark=high_watermark,
                    last_stable_offset=stable, log_start_offset=plog.log_start_offset,
                    aborted_transactions=aborted, preferred_read_replica=-1, records=records))
            except KafkaError as exc:
                errors = True
                partitions.append(build(
                    PartitionData, partition_index=part.partition, error_code=error(exc.code), high_watermark=-1,
                    last_stable_offset=-1, log_start_offset=-1, aborted_transactions=None,
                    preferred_read_replica=-1, records=b""))
        topics.append(build(TopicResponse, topic=topic.topic, partitions=tuple(partitions)))
    return tuple(topics), total, errors


def _read_within(plog, offset: int, limit: int, upper: int | None) -> tuple[bytes, int]:
    """Whole batches that fit in ``limit`` bytes (none if the first one does not fit), and the offset after."""
    if limit <= 0:
        plog.check_fetch_offset(offset)
        return b"", offset
    data, end = plog.read_range(offset, limit, upper)
    return (data, end) if len(data) <= limit else (b"", offset)


@handles(ApiKey.FETCH, 4, 12)  # 13+ addresses topics by id
async def handle(broker, request):
    """Answer Fetch once min_bytes are there, an error occurs or max_wait expires; None if the client went away."""
    body, rt = request.body, request.response_type()
    version = request.version
    if version >= 7 and body.session_id != 0:
        return build(rt, throttle_time=NO_THROTTLE, error_code=ErrorCode.fetch_session_id_not_found,
                     session_id=0, responses=())
    max_wait = max(body.max_wait.total_seconds(), 0.0)
    deadline = time.monotonic() + max_wait
    keys = [(t.topic, p.partition) for t in body.topics for p in t.partitions]
    while True:
        # Register before reading, so a produce between the read and the wait is not missed.
        waiter = broker.data_waiter(keys)
        try:
            topics, total, errors = _read(broker, body, rt)
            remaining = deadline - time.monotonic()
            if total >= body.min_bytes or errors or remaining <= 0 or not keys:
                break
            watched = {waiter} if request.gone is None else {waiter, request.gone}
            await asyncio.wait(watched, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if request.gone is not None and request.gone.done():
                return None  # nobody to answer
        finally:
            broker.drop_waiter(keys, waiter)
    return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, session_id=0, responses=topics)
