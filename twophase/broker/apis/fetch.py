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

Response size: partition_max_bytes per partition and max_bytes for the whole response, both
capped by the broker's ``fetch_max_bytes`` (Kafka's fetch.max.bytes), except that the first
partition with data always gets at least one whole batch (KIP-74), so a batch larger than the
limits cannot stall a consumer.

Cost: record bytes are read a step at a time, yielding to the event loop between steps, and each
step is taken from a budget shared by every connection's Fetch responses (``fetch_bytes_in_flight``)
and given back once the response has been written. The first step of a response waits for the
budget, but no longer than the Fetch's max_wait and only while its client is there: then it is
answered with what it has (often nothing), and the client asks again. A later step that does not fit
ends the response there. One response takes at most ``1/RESPONSES_PER_BUDGET`` of the budget (beyond
its first batch), so a few clients reading their responses slowly cannot hold all of it.
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

# Record bytes read (and taken from the fetch budget) at a time, between yields to the event loop.
READ_STEP_BYTES = 1024 * 1024
# One response's share of the fetch budget is at most this fraction of it: it takes this many slow
# readers to hold the whole budget (and even then other Fetches wait only until their max_wait).
RESPONSES_PER_BUDGET = 8


class _Held:
    """The fetch-budget bytes one response holds (its record bytes read so far); the budget is waited
    for until ``deadline`` (time.monotonic()) or until ``gone`` (the client left) is done."""

    def __init__(self, budget, deadline: float, gone: asyncio.Future | None) -> None:
        self.budget = budget
        self.deadline = deadline
        self.gone = gone
        self.bytes = 0
        self._unyielded = 0  # bytes read since the event loop last ran something else

    async def acquire_first(self, size: int) -> int | None:
        """Budget for a response's first bytes (the amount taken), waiting for them at most until the
        deadline or the client is gone: None then."""
        taken = self.budget.try_acquire(size)
        if taken is not None:
            return taken
        acquiring = asyncio.ensure_future(self.budget.acquire(size))
        watched = {acquiring} if self.gone is None else {acquiring, self.gone}
        await asyncio.wait(watched, timeout=max(0.0, self.deadline - time.monotonic()),
                           return_when=asyncio.FIRST_COMPLETED)
        if not acquiring.done():
            acquiring.cancel()  # ByteBudget.acquire gives back what was granted as it was cancelled
            await asyncio.wait({acquiring})
        return None if acquiring.cancelled() else acquiring.result()

    async def pace(self, read: int) -> None:
        """After ``read`` more bytes: let other connections' requests run once a step's worth was read."""
        self._unyielded += read
        if self._unyielded >= READ_STEP_BYTES:
            self._unyielded = 0
            await asyncio.sleep(0)

    def settle(self, taken: int, keep: int) -> None:
        """A read for which ``taken`` bytes were reserved returned ``keep`` bytes to keep: give back the
        rest, or take the excess at once (a first batch larger than the step goes out whole)."""
        if keep > taken:
            self.budget.take(keep - taken)
        else:
            self.budget.release(taken - keep)
        self.bytes += keep

    def release(self) -> None:
        """Give everything back (the response was written, or is not sent)."""
        self.budget.release(self.bytes)
        self.bytes = 0


async def _read(broker, body, rt, held: _Held) -> tuple[tuple, int, bool]:
    """(topic responses, bytes of records, whether any partition has an error); ``held`` holds the
    record bytes in the fetch budget."""
    TopicResponse, PartitionData = nested(rt, "FetchableTopicResponse"), nested(rt, "PartitionData")
    AbortedTransaction = nested(rt, "AbortedTransaction")
    committed = body.isolation_level == READ_COMMITTED
    budget = min(max(0, body.max_bytes), broker.config.fetch_max_bytes,
                 max(1, held.budget.capacity // RESPONSES_PER_BUDGET))
    total = 0
    errors = False
    budget_short = False
    topics = []
    for topic in body.topics:
        partitions = []
        for part in topic.partitions:
            try:
                plog = broker.partition_log(topic.topic, part.partition)
                high_watermark = plog.high_watermark
                stable = plog.last_stable_offset
                # Not beyond what this answer reports, however much arrives while it is read.
                upper = stable if committed else high_watermark
                limit = min(part.partition_max_bytes, budget - total)
                if budget_short:
                    limit = 0
                records, end, short = await _read_partition(
                    plog, part.fetch_offset, limit, upper, held, first=total == 0 and not budget_short)
                budget_short = budget_short or short
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


async def _read_partition(plog, offset: int, limit: int, upper: int, held: _Held, *,
                          first: bool) -> tuple[bytes, int, bool]:
    """Whole batches from ``offset`` below ``upper`` that fit in ``limit`` bytes, and the offset after
    them; with ``first`` (nothing in the response yet) at least one whole batch, even above the limits.

    Read a step at a time, each taken from the fetch budget first; the third value is True when the
    budget was short, so the response should take nothing more."""
    plog.check_fetch_offset(offset)
    pieces: list[bytes] = []
    got = 0
    end = offset
    while end < upper:
        must = first and not got
        want = min(READ_STEP_BYTES, limit - got)
        if want <= 0 and not must:
            break
        want = max(want, 1)
        if must:
            taken = await held.acquire_first(want)  # the response's first bytes: worth waiting for
            if taken is None:
                return b"", end, True
        else:
            taken = held.budget.try_acquire(want)
            if taken is None:
                return b"".join(pieces), end, True
        try:
            data, after = plog.read_range(end, want, upper)
        except BaseException as exc:
            held.budget.release(taken)
            if got and isinstance(exc, KafkaError):
                break  # say retention removed what follows meanwhile: answer with what was read
            raise
        keep = len(data) if data and (must or got + len(data) <= limit) else 0
        held.settle(taken, keep)
        if not keep:
            break  # nothing more below ``upper``, or a batch larger than what is left
        pieces.append(data)
        got += keep
        end = after
        await held.pace(keep)
    return b"".join(pieces), end, False


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
    held = _Held(broker.fetch_budget, deadline, request.gone)
    try:
        while True:
            # Register before reading, so a produce between the read and the wait is not missed.
            waiter = broker.data_waiter(keys)
            try:
                topics, total, errors = await _read(broker, body, rt, held)
                remaining = deadline - time.monotonic()
                if total >= body.min_bytes or errors or remaining <= 0 or not keys:
                    break
                held.release()  # parked: what was read is read again when woken
                watched = {waiter} if request.gone is None else {waiter, request.gone}
                await asyncio.wait(watched, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if request.gone is not None and request.gone.done():
                    return None  # nobody to answer
            finally:
                broker.drop_waiter(keys, waiter)
    except BaseException:
        held.release()
        raise
    request.after_answer.append(held.release)  # the records stay in memory until written
    return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, session_id=0, responses=topics)
