"""The consumer: assign or subscribe, seek, read_committed or read_uncommitted, long polling.

read_committed works as Kafka's consumers do: the broker returns data only below the last stable
offset plus the aborted transactions (producer id, first offset) overlapping it; batches of a
producer are skipped from its aborted transaction's first offset up to its abort marker. Control
batches are never returned. Offsets are committed only by :meth:`Consumer.commit`; partitions that
move to another member in a rebalance continue there from the group's committed offset
(at-least-once unless the caller commits before it polls again).

What a broker sends is not trusted: each batch's CRC and records are checked, and a compressed
batch is inflated only up to ``max_inflated_batch_bytes`` (64 MiB by default: generous for real
batches, which producers cap at about 1 MiB before compression; a 1 MB gzip bomb costs at most that
much memory, however far it would inflate). A batch that fails is a :class:`CorruptRecordBatch`:
``poll`` returns the records before it, then raises it (again at each poll, until the caller seeks
past it); so is an offset the broker refuses as damaged (CORRUPT_MESSAGE). With
``on_corrupt="skip"`` the consumer moves past it instead, counts it in ``corrupt_batches_skipped``
and logs a WARNING naming the topic, partition and offsets. The damaged batch's header is not
trusted (its lastOffsetDelta is under the failed CRC): it is skipped to the next intact batch of
the same response, else one offset on; offsets the broker refuses are skipped one by one, logged
when the run starts and when the broker serves the partition again.

A position the broker answers OFFSET_OUT_OF_RANGE for (retention deleted the records there, or the
topic was recreated) is reset to ``auto_offset_reset`` ("earliest" or "latest", logged as a WARNING);
with ``auto_offset_reset="none"`` ``poll`` raises :class:`OffsetOutOfRange` instead (after the
records fetched before it), and again at each poll until the caller seeks: a reader that must not
skip records silently (the Spark source) decides itself.

Example::

    c = Consumer("127.0.0.1:9092", isolation_level="read_committed", group_id="g")
    c.subscribe(["orders"])                   # or c.assign([("orders", 0)]); c.seek("orders", 0, 42)
    for m in c.poll(timeout_s=1.0):
        print(m.offset, m.key, m.value, m.headers)
    c.commit()                                # the positions of what poll returned
    c.close()
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import (
    CorruptRecordError,
    InvalidRecordError,
    KafkaError,
    MessageTooLargeError,
)
from twophase.wire.records import (
    DEFAULT_MAX_INFLATED_BYTES,
    HEADER_SIZE,
    INT32_MAX,
    LOG_OVERHEAD,
    decode_batch_records,
    parse_control_record,
    parse_header,
    validate_batch,
)

from .cluster import Cluster
from .connection import MS
from .errors import CorruptRecordBatch, OffsetOutOfRange, error_for
from .group import GroupMember, TopicPartitionKey
from .messages import message, part
from .retry import retry
from .security import SecuritySettings, as_security

log = logging.getLogger("twophase.client")

EARLIEST, LATEST = -2, -1  # ListOffsets' special timestamps (seek to them)
ISOLATION_LEVELS = {"read_uncommitted": 0, "read_committed": 1}
_ON_CORRUPT = ("raise", "skip")
_RESET = {"earliest": EARLIEST, "latest": LATEST, "none": None}
_UNREADABLE = (CorruptRecordError, InvalidRecordError, MessageTooLargeError)  # what makes a batch corrupt


@dataclasses.dataclass(frozen=True)
class Message:
    """One record as the consumer returns it: where it is (topic, partition, offset) and what it holds."""
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp_ms: int
    timestamp_type: int = 0  # 0: CreateTime (set by the producer), 1: LogAppendTime (set by the broker)


class PartitionRecords(NamedTuple):
    """What one partition's fetched data holds from a position on (see :func:`records_of`)."""

    messages: list[Message]
    position: int  # where to read next: after the last batch read, or at the corrupt batch
    corrupt: CorruptRecordBatch | None  # the first batch that cannot be read: nothing after it was read
    skipped: tuple[CorruptRecordBatch, ...] = ()  # with skip_corrupt: the batches read past instead


def records_of(topic: str, partition: int, data: bytes, position: int, aborted: Iterable[tuple[int, int]],
               read_committed: bool, max_inflated_bytes: int = DEFAULT_MAX_INFLATED_BYTES, *,
               skip_corrupt: bool = False) -> PartitionRecords:
    """Messages at or after ``position`` in the complete batches of ``data``, and the next position.

    ``aborted`` is the Fetch response's (producer id, first offset) list; with ``read_committed``
    transactional batches of aborted transactions and all control batches are dropped. Reading stops
    at the first batch that cannot be read (CRC, records, more than ``max_inflated_bytes`` inflated);
    with ``skip_corrupt`` it goes on past it to its ``next_offset`` (see CorruptRecordBatch): into the
    next batch of ``data`` when that one is intact, else the next fetch goes on from there.
    """
    pending = sorted((first, pid) for pid, first in aborted) if read_committed else []
    aborting: set[int] = set()
    out: list[Message] = []
    skipped: list[CorruptRecordBatch] = []
    pos = 0
    while pos + LOG_OVERHEAD <= len(data):
        header = parse_header(data, pos) if pos + HEADER_SIZE <= len(data) else None
        if header is None or pos + header.size > len(data):
            break  # the broker cuts the last batch at the size limit
        batch = memoryview(data)[pos : pos + header.size]
        try:
            validate_batch(data, pos)
        except _UNREADABLE as exc:
            corrupt, follows = _damaged(topic, partition, data, pos, header, position, str(exc))
        else:
            while pending and pending[0][0] <= header.last_offset:
                aborting.add(heapq.heappop(pending)[1])
            try:
                if header.is_control:
                    if not parse_control_record(batch).commit:
                        aborting.discard(header.producer_id)
                elif not (header.is_transactional and header.producer_id in aborting):
                    stamped_by = int(header.has_log_append_time)  # the timestamp type is the batch's
                    out.extend(Message(topic, partition, r.offset, r.key, r.value, r.headers, r.timestamp_ms,
                                       stamped_by)
                               for r in decode_batch_records(batch, max_inflated_bytes) if r.offset >= position)
                corrupt, follows = None, True
            except _UNREADABLE as exc:  # under an intact CRC: the header's offsets and length hold
                corrupt = CorruptRecordBatch(topic, partition, header.base_offset, header.last_offset, str(exc),
                                             header.last_offset + 1)
                follows = True
        if corrupt is not None:
            if not skip_corrupt:
                return PartitionRecords(out, position, corrupt)
            skipped.append(corrupt)
            position = max(position, corrupt.next_offset)
            if not follows:
                break
        else:
            position = max(position, header.last_offset + 1)
        pos += header.size
    return PartitionRecords(out, position, None, tuple(skipped))


def _damaged(topic: str, partition: int, data: bytes, pos: int, header, position: int,
             reason: str) -> tuple[CorruptRecordBatch, bool]:
    """The batch at ``pos`` whose CRC or framing failed, with where reading can go on; and whether that
    is the batch after it in ``data``. Its header is under the failed check: its lastOffsetDelta and
    length are not trusted (a flipped delta would jump far ahead), only the next batch if it is intact
    and ahead; else reading goes on one offset past the damaged batch's first one not yet read."""
    try:
        following = validate_batch(data, pos + header.size)
    except _UNREADABLE:
        following = None  # none in this response, or not trustworthy
    follows = following is not None and following.base_offset > header.base_offset
    next_offset = following.base_offset if follows else max(position, header.base_offset) + 1
    return CorruptRecordBatch(topic, partition, header.base_offset, header.last_offset, reason, next_offset), follows


class Consumer:
    """A Kafka consumer: assigned partitions or a group subscription, read_committed or not, long polling.

    Not thread-safe: call it from one thread (a group member's heartbeats run
    in a thread of their own).

    Usage::

        with Consumer("127.0.0.1:9092", group_id="g", isolation_level="read_committed") as c:
            c.subscribe(["orders"])            # or, without a group: c.assign([("orders", 0)])
            for m in c.poll(timeout_s=1.0):
                print(m.topic, m.partition, m.offset, m.key, m.value, m.headers)
            c.commit()                         # the positions after what poll returned
            c.committed([("orders", 0)])       # {("orders", 0): offset}, -1 if none

    A batch that cannot be read, or an offset the broker refuses as damaged, raises
    :class:`CorruptRecordBatch` from ``poll`` (after the records before it); ``on_corrupt="skip"``
    skips it instead, counted in ``corrupt_batches_skipped`` (a run of refused offsets counts once)
    and logged. ``max_inflated_batch_bytes`` bounds what one compressed batch may inflate to.

    ``auto_offset_reset`` ("earliest", "latest" or "none") is where a partition without a committed
    offset starts, and where a position out of range moves; with "none" the first is a KafkaError and the
    second an :class:`OffsetOutOfRange` from ``poll`` (the position stays until the caller seeks).

    ``security``: TLS and SASL settings, as the :class:`~twophase.client.Producer` takes them.
    """
    def __init__(self, bootstrap: str, *, group_id: str | None = None, isolation_level: str = "read_uncommitted",
                 auto_offset_reset: str = "earliest", max_wait_ms: int = 500, min_bytes: int = 1,
                 max_partition_bytes: int = 1 << 20, max_bytes: int = 50 << 20, session_timeout_ms: int = 10_000,
                 rebalance_timeout_ms: int = 30_000, heartbeat_interval_ms: int = 1_000,
                 request_timeout_ms: int = 30_000, client_id: str = "twophase-consumer",
                 max_inflated_batch_bytes: int = DEFAULT_MAX_INFLATED_BYTES, on_corrupt: str = "raise",
                 security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
        if isolation_level not in ISOLATION_LEVELS:
            raise ValueError(f"isolation_level must be read_committed or read_uncommitted, not {isolation_level!r}")
        if auto_offset_reset not in _RESET:
            raise ValueError(f"auto_offset_reset must be earliest, latest or none, not {auto_offset_reset!r}")
        if on_corrupt not in _ON_CORRUPT:
            raise ValueError(f"on_corrupt must be raise or skip, not {on_corrupt!r}")
        if not 1 <= max_inflated_batch_bytes <= INT32_MAX - HEADER_SIZE:  # a batch's length is an int32
            raise ValueError(f"max_inflated_batch_bytes must be between 1 and 2 GiB, not {max_inflated_batch_bytes}")
        self.group_id = group_id
        self.isolation = ISOLATION_LEVELS[isolation_level]
        self.reset = _RESET[auto_offset_reset]  # None: raise instead of resetting
        self.max_wait_ms, self.min_bytes = max_wait_ms, min_bytes
        self.max_partition_bytes, self.max_bytes = max_partition_bytes, max_bytes
        self.max_inflated_batch_bytes, self.on_corrupt = max_inflated_batch_bytes, on_corrupt
        self.corrupt_batches_skipped = 0  # batches (and runs of refused offsets) skipped under on_corrupt="skip"
        self._cluster = Cluster(bootstrap, client_id=client_id, request_timeout_s=request_timeout_ms / 1000,
                                security=as_security(security))
        self._group = (GroupMember(self._cluster, group_id, session_timeout_ms=session_timeout_ms,
                                   rebalance_timeout_ms=rebalance_timeout_ms,
                                   heartbeat_interval_ms=heartbeat_interval_ms) if group_id else None)
        self._subscribed = False
        self._assigned: list[TopicPartitionKey] = []
        self._positions: dict[TopicPartitionKey, int] = {}
        self._buffer: collections.deque[Message] = collections.deque()
        # A corrupt batch or an offset out of range (auto_offset_reset="none"): raised once the buffer is empty.
        self._failed: dict[TopicPartitionKey, CorruptRecordBatch | OffsetOutOfRange] = {}
        self._refused: dict[TopicPartitionKey, int] = {}  # first offset of a run the broker refuses, being skipped
        self._last_skipped: dict[TopicPartitionKey, int] = {}  # base offset of the damaged batch skipped last

    # --- assignment ---------------------------------------------------------------------------

    def assign(self, partitions: Iterable[TopicPartitionKey]) -> None:
        """Read exactly these (topic, partition) pairs; KafkaError after subscribe()."""
        if self._subscribed:
            raise KafkaError("assign() after subscribe(): use one or the other")
        self._set_assignment(list(partitions))

    def subscribe(self, topics: Iterable[str]) -> None:
        """Join the group for ``topics`` (assigned at the next poll); KafkaError without group_id or after assign()."""
        if self._group is None:
            raise KafkaError("subscribe() needs a group_id")
        if self._assigned and not self._subscribed:
            raise KafkaError("subscribe() after assign(): use one or the other")
        self._subscribed = True
        self._group.subscribe(topics)

    def assignment(self) -> list[TopicPartitionKey]:
        """The partitions currently assigned, sorted."""
        return list(self._assigned)

    def _set_assignment(self, partitions: list[TopicPartitionKey]) -> None:
        self._assigned = sorted(set(partitions))
        self._positions = {tp: o for tp, o in self._positions.items() if tp in self._assigned}
        self._buffer = collections.deque(m for m in self._buffer if (m.topic, m.partition) in self._assigned)
        self._failed = {tp: e for tp, e in self._failed.items() if tp in self._assigned}
        self._refused = {tp: o for tp, o in self._refused.items() if tp in self._assigned}
        self._last_skipped = {tp: o for tp, o in self._last_skipped.items() if tp in self._assigned}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``topic``-``partition`` from ``offset`` next (EARLIEST/LATEST: -2/-1 resolve via ListOffsets)."""
        tp = (topic, partition)
        if tp not in self._assigned:
            raise KafkaError(f"{topic}-{partition} is not assigned to this consumer")
        self._buffer = collections.deque(m for m in self._buffer if (m.topic, m.partition) != tp)
        self._failed.pop(tp, None)
        self._end_refused_run(tp, self._positions.get(tp))
        self._positions[tp] = self._list_offset(tp, offset) if offset < 0 else offset

    def position(self, topic: str, partition: int) -> int | None:
        """The offset the partition is read from next, or None before it is known."""
        return self._positions.get((topic, partition))

    # --- offsets ------------------------------------------------------------------------------

    def _list_offset(self, tp: TopicPartitionKey, timestamp: int) -> int:
        def call() -> int:
            conn = self._cluster.leader_connection(*tp)
            v = conn.version(ApiKey.LIST_OFFSETS, 7, 2)
            request = message(ApiKey.LIST_OFFSETS, v, replica_id=-1, isolation_level=self.isolation, topics=(
                part(ApiKey.LIST_OFFSETS, v, "ListOffsetsTopic", name=tp[0], partitions=(
                    part(ApiKey.LIST_OFFSETS, v, "ListOffsetsPartition", partition_index=tp[1],
                         current_leader_epoch=-1, timestamp=timestamp),)),))
            [topic] = conn.request(request).topics
            [p] = topic.partitions
            if p.error_code:
                self._cluster.invalidate(tp[0])
                raise error_for(p.error_code, f"ListOffsets({tp[0]}-{tp[1]})")
            return int(p.offset)

        return retry(call, self._cluster.request_timeout_s, f"ListOffsets for {tp[0]}-{tp[1]}")

    def _initialize_positions(self) -> None:
        missing = [tp for tp in self._assigned if tp not in self._positions]
        if not missing:
            return
        committed = self._group.committed(missing) if self._group else {}
        for tp in missing:
            offset = committed.get(tp, -1)
            if offset < 0 and self.reset is None:
                raise KafkaError(f"{tp[0]}-{tp[1]} has no committed offset and auto_offset_reset is none: seek first")
            self._positions[tp] = offset if offset >= 0 else self._list_offset(tp, self.reset)

    def commit(self, offsets: dict[TopicPartitionKey, int] | None = None) -> None:
        """Commit ``offsets`` (default: the positions after what poll returned) to the group."""
        if self._group is None:
            raise KafkaError("commit() needs a group_id")
        if offsets is None:
            offsets = dict(self._positions)
            for m in reversed(self._buffer):  # fetched but not yet returned: not consumed
                offsets[(m.topic, m.partition)] = m.offset
        self._group.commit(offsets)

    def committed(self, partitions: Iterable[TopicPartitionKey]) -> dict[TopicPartitionKey, int]:
        """The group's committed offsets of ``partitions`` (-1: none); KafkaError without a group_id."""
        if self._group is None:
            raise KafkaError("committed() needs a group_id")
        return self._group.committed(list(partitions))

    # --- polling ------------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[Message]:
        """Up to ``max_records`` messages, waiting up to ``timeout_s`` for the first (long polling).

        Raises CorruptRecordBatch for a batch that cannot be read, and OffsetOutOfRange (auto_offset_reset="none")
        for a position the broker holds no record at, once the messages before it are returned.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self._subscribed:
                new = self._group.ensure_active()
                if new is not None:
                    self._set_assignment(new)
            if self._buffer:
                return [self._buffer.popleft() for _ in range(min(max_records, len(self._buffer)))]
            if self._failed:  # the position stays there: the next poll fetches and raises it again
                raise self._failed.pop(next(iter(self._failed)))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            self._initialize_positions()
            if not self._assigned:
                time.sleep(min(remaining, 0.05))  # nothing assigned (yet): no fetch to wait on
                continue
            if not self._fetch(min(int(remaining * 1000), self.max_wait_ms)):
                time.sleep(min(max(0.0, deadline - time.monotonic()), 0.1))  # broker unreachable: no busy loop

    def _fetch(self, max_wait_ms: int) -> bool:
        """One fetch round over the leaders; False if a broker could not be asked."""
        ok = True
        by_leader: dict[int, list[TopicPartitionKey]] = collections.defaultdict(list)
        for tp in self._assigned:
            try:
                by_leader[self._cluster.leader(*tp)].append(tp)
            except KafkaError as exc:
                log.info("no leader for %s: %s", tp, exc)
                ok = False
        for i, (node, partitions) in enumerate(by_leader.items()):
            try:
                # Only the first broker may park the fetch: the others are asked for what they have now
                # (data arriving there meanwhile waits at most max_wait_ms).
                self._fetch_from(node, partitions, max_wait_ms if i == 0 else 0)
            except KafkaError as exc:
                if not exc.retriable:
                    raise
                log.info("fetch from broker %d failed: %s", node, exc)
                ok = False
                for topic in {t for t, _ in partitions}:
                    self._cluster.invalidate(topic)
        return ok

    def _fetch_from(self, node: int, partitions: list[TopicPartitionKey], max_wait_ms: int) -> None:
        conn = self._cluster.connection(node)
        v = conn.version(ApiKey.FETCH, 12, 4)
        by_topic: dict[str, list[int]] = collections.defaultdict(list)
        for topic, partition in partitions:
            by_topic[topic].append(partition)
        request = message(
            ApiKey.FETCH, v, replica_id=-1, max_wait=max_wait_ms * MS, min_bytes=self.min_bytes,
            max_bytes=self.max_bytes, isolation_level=self.isolation, session_id=0, session_epoch=-1, rack_id="",
            forgotten_topics_data=(), topics=tuple(part(ApiKey.FETCH, v, "FetchTopic", topic=t, partitions=tuple(
                part(ApiKey.FETCH, v, "FetchPartition", partition=p, current_leader_epoch=-1,
                     fetch_offset=self._positions[(t, p)], last_fetched_epoch=-1, log_start_offset=-1,
                     partition_max_bytes=self.max_partition_bytes) for p in ps)) for t, ps in by_topic.items()))
        response = conn.request(request, self._cluster.request_timeout_s + max_wait_ms / 1000)
        if response.error_code:
            raise error_for(response.error_code, "Fetch")
        for topic in response.responses:
            for p in topic.partitions:
                tp = (topic.topic, int(p.partition_index))
                if tp not in self._positions:
                    continue  # reassigned or sought meanwhile
                if p.error_code == ErrorCode.offset_out_of_range:
                    if self.reset is None:
                        self._failed[tp] = OffsetOutOfRange(tp[0], tp[1], self._positions[tp])
                        continue
                    log.warning("offset %d out of range for %s: resetting", self._positions[tp], tp)
                    self._end_refused_run(tp, self._positions[tp])
                    self._positions[tp] = self._list_offset(tp, self.reset)
                elif p.error_code == ErrorCode.corrupt_message:
                    # The broker found the batch at this offset damaged: a retry gets the same answer (Kafka's
                    # consumer raises here too), so say so rather than retry forever, or skip it.
                    self._refused_offset(tp)
                elif p.error_code:
                    raise error_for(p.error_code, f"Fetch({tp[0]}-{tp[1]})")
                else:
                    self._end_refused_run(tp, self._positions[tp])
                    if p.records:
                        self._read(tp, p)

    def _read(self, tp: TopicPartitionKey, p) -> None:
        """Buffer the messages of one partition's fetched records and move its position past them."""
        aborted = [(int(a.producer_id), int(a.first_offset)) for a in (p.aborted_transactions or ())]
        read = records_of(tp[0], tp[1], p.records, self._positions[tp], aborted, self.isolation == 1,
                          self.max_inflated_batch_bytes, skip_corrupt=self.on_corrupt == "skip")
        self._buffer.extend(read.messages)
        self._positions[tp] = read.position
        if read.corrupt is not None:
            self._failed[tp] = read.corrupt  # poll raises it
        for corrupt in read.skipped:
            self._skipped_batch(tp, corrupt)

    def _skipped_batch(self, tp: TopicPartitionKey, corrupt: CorruptRecordBatch) -> None:
        """Count and log a batch skipped under on_corrupt="skip", once: a broker trusting the damaged
        header may send it again ahead of the batches after it."""
        if self._last_skipped.get(tp) == corrupt.base_offset:
            return
        self._last_skipped[tp] = corrupt.base_offset
        self.corrupt_batches_skipped += 1
        log.warning("skipped %s; reading on from offset %d (on_corrupt=skip; %d skipped so far)", corrupt,
                    corrupt.next_offset, self.corrupt_batches_skipped)

    def _refused_offset(self, tp: TopicPartitionKey) -> None:
        """The broker refused the position as damaged (CORRUPT_MESSAGE): keep it for poll to raise, or
        (on_corrupt="skip") step one offset on; the broker tells where its damage ends by serving again."""
        at = self._positions[tp]
        if self.on_corrupt != "skip":
            self._failed[tp] = CorruptRecordBatch(tp[0], tp[1], at, at, "the broker holds a damaged batch here "
                                                   "and refuses to serve it (CORRUPT_MESSAGE)")
            return
        if tp not in self._refused:  # logged once per run, not per offset
            self._refused[tp] = at
            self.corrupt_batches_skipped += 1
            log.warning("%s-%d: the broker refuses offset %d as damaged (CORRUPT_MESSAGE); skipping offsets until "
                        "it serves records again (on_corrupt=skip; %d skipped so far)", tp[0], tp[1], at,
                        self.corrupt_batches_skipped)
        self._positions[tp] = at + 1

    def _end_refused_run(self, tp: TopicPartitionKey, served_from: int | None) -> None:
        """The run of refused offsets of ``tp`` (if any) is over: log what was skipped."""
        first = self._refused.pop(tp, None)
        if first is not None:
            log.warning("%s-%d: skipped offsets %d..%d the broker refused as damaged (on_corrupt=skip)",
                        tp[0], tp[1], first, served_from - 1)

    def close(self) -> None:
        """Leave the group (if subscribed) and close every connection; final."""
        try:
            if self._group is not None:
                self._group.leave()
        finally:
            self._cluster.close()  # the connections go whatever leaving the group raised

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
