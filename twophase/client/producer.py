"""The producer: idempotent always, transactional with a transactional id, KIP-939 prepare/resume.

A background sender thread turns per-partition batches into Produce requests, up to
``max_in_flight`` of them pipelined on a broker's connection (Kafka's
``max.in.flight.requests.per.connection``): request *i* carries each partition's *i*-th due batch, so
a partition's batches reach the broker in sequence order. When one fails, those after it wait and are
resent after it (same producer id, epoch and sequence: the broker deduplicates any it already wrote,
as it remembers a partition's last five); when one is dropped for good, the ones sent after it are
dropped with it (reported, never sealed again: the broker may hold them). Batches go out when full
(``batch_size``), after ``linger_ms``, or on flush; a send that finds ``buffer_memory`` bytes queued
waits for room (Kafka's back-pressure), for at most ``max_block_ms``. In a transaction a partition is
added (AddPartitionsToTxn) at its first record, during that linger. Errors of background sends are raised by the next flush, commit
or send.

Example::

    p = Producer("127.0.0.1:9092", transactional_id="t1", enable_2pc=True)
    p.init_transactions()
    p.begin_transaction()
    p.send("topic", value=b"v", key=b"k", headers=[("h", b"x")])
    handle = p.prepare_transaction()              # flushed; store handle.to_json() somewhere durable
    Producer.complete_prepared("127.0.0.1:9092", handle, commit=True)   # from any process, any time
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.compression import codec_id
from twophase.wire.errors import KafkaError
from twophase.wire.records import INT32_MAX, seal_batch, unsealed_batch

from .cluster import Cluster, CoordinatorType
from .connection import MS, Connection
from .errors import KafkaTimeout, ProducerFenced, TransactionStateError, check, error_for
from .flushed import complete_flushed
from .messages import message, part
from .partitioner import StickyPartitions, key_partition, murmur2_many, partition_for_key
from .prepared import complete_prepared
from .retry import retry
from .security import SecuritySettings, as_security
from .transactions import PreparedTxn, TxnState, TxnStateMachine, init_producer_id

log = logging.getLogger("twophase.client")

RECORD_OVERHEAD = 24  # rough per-record bytes beyond key, value and headers, for batch sizing
Header = tuple[str, bytes | None]
OutRecord = tuple[str, int | None, bytes | None, bytes | None, Sequence[Header] | None, int | None]  # send_many's
HAND_OVER_TIMEOUT_S = 1.0  # the longest a send waits for the idle sender to wake for new partitions
_BYTES_LIKE = (bytes, bytearray, memoryview)
MAX_IN_FLIGHT = 5  # Kafka's limit for idempotence: brokers remember a partition's last five batches
SEND_MANY_CHUNK = 1024  # send_many lets the sender thread take the lock between chunks of this many records


def _check_record(key: object, value: object, headers: Sequence[tuple[object, object]]) -> None:
    """TypeError for a record the sender could not encode, raised by the send instead of in the background."""
    for what, data in (("key", key), ("value", value), *((f"header {name!r}", data) for name, data in headers)):
        if data is not None and not isinstance(data, _BYTES_LIKE):
            raise TypeError(f"a record's {what} must be bytes-like or None, not {type(data).__name__}")
    for name, _ in headers:
        if not isinstance(name, str):
            raise TypeError(f"a record header's name must be a str, not {type(name).__name__}: {name!r}")


class _Unencodable(Exception):
    """A batch the sender could not encode (args: the batch, the cause): it fails once it is its queue's head."""


@dataclasses.dataclass
class _Batch:
    topic: str
    partition: int
    created: float
    records: list[tuple[int, bytes | None, bytes | None, Sequence[Header]]] = dataclasses.field(default_factory=list)
    size: int = 0
    closed: bool = False          # no more appends: it is (being) sent
    unsealed: bytearray | None = None  # its records encoded ahead, during the round trip before it
    wire: bytes | None = None     # encoded once, with its sequence, so a retry resends the same bytes
    retry_at: float = 0.0
    attempts: int = 0


class Producer:
    """See the module docstring. Thread-safe for send/flush from several threads.

    ``buffer_memory`` bounds the bytes of records queued and not yet acknowledged (Kafka's
    ``buffer.memory``, 32 MB; it counts keys, values and headers, not the encoded copies of the
    batches being sent): a send that would exceed it sends what is queued at once and waits for
    acknowledgements to free room (waiting sends get it in the order they came), for at most
    ``max_block_ms`` per call, then raises KafkaTimeout (a record larger than the whole buffer is a
    ValueError, and so is one larger than ``max_request_size``, if given: Kafka's ``max.request.size``
    as it bounds a record). ``delivery_timeout_ms`` bounds how long a batch is retried (``retries``, if given, also
    caps the attempts); ``max_in_flight`` (1..5, Kafka's limit for idempotence) is how many Produce
    requests are sent to a broker before the first answer is read; ``transaction_timeout_ms`` is the
    broker-side timeout of a non-2PC transaction; ``enable_2pc`` registers the producer for
    KIP-939 (its transactions never time out and can be prepared); ``compression`` is Kafka's
    compression.type: None or "none", "gzip", "snappy", "lz4" or "zstd" (ValueError for another name). ``security``: TLS and SASL settings, a
    :class:`~twophase.client.security.SecuritySettings` or a mapping of Kafka's names
    (``{"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", ...}``), or a source
    (``"file:client.properties"``, ``"env:KAFKA_"``) for :func:`~twophase.client.security.load_security`;
    None is PLAINTEXT.
    """

    def __init__(self, bootstrap: str, *, transactional_id: str | None = None, enable_2pc: bool = False,
                 transaction_timeout_ms: int = 60_000, linger_ms: int = 5, batch_size: int = 64 * 1024,
                 acks: str | int = "all", request_timeout_ms: int = 30_000, delivery_timeout_ms: int = 120_000,
                 retries: int | None = None, compression: str | None = None,
                 buffer_memory: int = 32 * 1024 * 1024, max_block_ms: int = 60_000, max_in_flight: int = 5,
                 max_request_size: int | None = None, client_id: str = "twophase-producer",
                 security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
        if acks not in ("all", -1):
            raise ValueError(f"the producer is idempotent, which needs acks='all', not {acks!r}")
        compression_id = codec_id("none" if compression is None else compression)
        if enable_2pc and transactional_id is None:
            raise ValueError("enable_2pc needs a transactional_id")
        self.transactional_id = transactional_id
        self.enable_2pc = enable_2pc
        self.transaction_timeout_ms = transaction_timeout_ms
        self.linger_s = linger_ms / 1000
        self.batch_size = batch_size
        self.request_timeout_s = request_timeout_ms / 1000
        self.delivery_timeout_s = delivery_timeout_ms / 1000
        self.retries = retries
        if buffer_memory < 1:
            raise ValueError(f"buffer_memory must be at least 1 byte, not {buffer_memory}")
        self.buffer_memory = buffer_memory
        if max_request_size is not None and max_request_size < 1:
            raise ValueError(f"max_request_size must be at least 1 byte, not {max_request_size}")
        self.max_request_size = max_request_size
        if not 1 <= max_in_flight <= MAX_IN_FLIGHT:
            raise ValueError(f"max_in_flight must be 1..{MAX_IN_FLIGHT} (the broker deduplicates a partition's "
                             f"last {MAX_IN_FLIGHT} batches), not {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.max_block_s = max_block_ms / 1000
        self._queued_bytes = 0  # of the records in self._queues (the lock held)
        # Sends waiting for room, first come first served: every queued batch is due meanwhile.
        self._room_waiters: collections.deque[object] = collections.deque()
        self._compression = compression_id
        self._cluster = Cluster(bootstrap, client_id=client_id, request_timeout_s=self.request_timeout_s,
                                security=as_security(security))
        self._txn = TxnStateMachine()
        self._producer_id = -1
        self._producer_epoch = -1
        self._sequences: dict[tuple[str, int], int] = collections.defaultdict(int)
        self._txn_partitions: set[tuple[str, int]] = set()
        self._sender_waiting = False  # the sender thread waits for work (in Condition.wait)
        self._sender_wakeups = 0  # how often it stopped waiting: a hand-over waits for the next one
        self._sequence_gap = False
        self._queues: dict[tuple[str, int], collections.deque[_Batch]] = {}
        self._sticky = StickyPartitions()
        self._errors: list[KafkaError] = []
        self._flushing = 0
        self._closing = False
        self._cond = threading.Condition()
        self._sender = threading.Thread(target=self._run, name="twophase-producer-sender", daemon=True)
        self._sender.start()

    # --- sending ------------------------------------------------------------------------------

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int | None = None,
             headers: Sequence[Header] | None = None, timestamp_ms: int | None = None) -> None:
        """Queue one record. Keys pick partitions with Kafka's murmur2; keyless records are sticky."""
        if self.transactional_id is not None:
            self._txn.require(TxnState.IN_TRANSACTION, action="send")
        self._raise_errors()
        headers = tuple(headers or ())
        _check_record(key, value, headers)
        partitions = self._cluster.partitions(topic, create=True)
        if partition is not None and partition not in partitions:
            raise ValueError(f"topic {topic!r} has partitions 0..{len(partitions) - 1}, not {partition}")
        if partition is None and key is not None:
            partition = partition_for_key(key, len(partitions))
        if timestamp_ms is not None and timestamp_ms < 0:
            raise ValueError(f"invalid timestamp {timestamp_ms}: a record's timestamp is non-negative or None (now)")
        timestamp = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        size = RECORD_OVERHEAD + len(key or b"") + len(value or b"") + sum(len(n) + len(v or b"") for n, v in headers)
        self._check_fits(size)
        deadline = time.monotonic() + self.max_block_s
        with self._cond:
            self._wait_for_room(size, deadline)
            if partition is None:
                partition = self._sticky.partition(topic, len(partitions))
            if self._append(topic, partition, (timestamp, key, value, headers), size):
                self._cond.notify_all()
                self._hand_over_new_partitions()

    def send_many(self, records: Iterable[OutRecord], timestamp_ms: int | None = None) -> int:
        """Queue many ``(topic, partition, key, value, headers, timestamp_ms)`` records, each as
        :meth:`send` would (partition None: by key, else sticky; headers a sequence of pairs or None;
        timestamp None: ``timestamp_ms``, else now); returns how many.

        For bulk writers (a sink writing an Arrow batch): the state checks, the clock and each topic's
        metadata are read once per call and the lock taken once per :data:`SEND_MANY_CHUNK` records,
        not per record. A record with a partition the topic lacks raises ValueError; earlier records
        may be queued already (in a transaction, abort it). So may they when the buffer stays full
        for ``max_block_ms`` (KafkaTimeout): a transaction then moves to ABORTABLE_ERROR.
        """
        if self.transactional_id is not None:
            self._txn.require(TxnState.IN_TRANSACTION, action="send")
        self._raise_errors()
        if timestamp_ms is not None and timestamp_ms < 0:
            raise ValueError(f"invalid timestamp {timestamp_ms}: a record's timestamp is non-negative or None (now)")
        now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        deadline = time.monotonic() + self.max_block_s
        counts: dict[str, int] = {}  # topic -> its number of partitions
        sent, records = 0, iter(records)
        while chunk := list(itertools.islice(records, SEND_MANY_CHUNK)):
            queued = []
            hashes = iter(murmur2_many([key for _, partition, key, *_ in chunk if partition is None and key is not None]))
            for topic, partition, key, value, headers, timestamp in chunk:
                count = counts.get(topic)
                if count is None:
                    count = counts[topic] = len(self._cluster.partitions(topic, create=True))
                if partition is None:
                    if key is not None:
                        partition = key_partition(next(hashes), count)
                elif not 0 <= partition < count:
                    raise ValueError(f"topic {topic!r} has partitions 0..{count - 1}, not {partition}")
                if timestamp is not None and timestamp < 0:
                    raise ValueError(f"invalid timestamp {timestamp}: a record's timestamp is non-negative or None")
                if not (value is None or isinstance(value, _BYTES_LIKE)) or not (key is None or
                                                                                 isinstance(key, _BYTES_LIKE)):
                    _check_record(key, value, ())
                size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
                if headers:
                    headers = tuple(headers)
                    _check_record(None, None, headers)
                    size += sum(len(n) + len(v or b"") for n, v in headers)
                else:
                    headers = ()
                self._check_fits(size)
                queued.append((topic, partition, (now if timestamp is None else timestamp, key, value, headers), size))
            wake = False
            with self._cond:
                for i, (topic, partition, record, size) in enumerate(queued):
                    if self._room_waiters or self._queued_bytes + size > self.buffer_memory or self._closing:
                        if wake:  # the batches this chunk filled must go out to make room
                            self._cond.notify_all()
                        try:
                            self._wait_for_room(size, deadline)
                        except KafkaError:
                            if sent + i and self._txn.state is TxnState.IN_TRANSACTION:
                                self._txn.transition(TxnState.ABORTABLE_ERROR)  # part of the call is queued
                            raise
                    if partition is None:
                        partition = self._sticky.partition(topic, counts[topic])
                    wake = self._append(topic, partition, record, size) or wake
                if wake:
                    self._cond.notify_all()
                    self._hand_over_new_partitions()
            sent += len(queued)
        return sent

    def _check_fits(self, size: int) -> None:
        if size > self.buffer_memory:
            raise ValueError(f"a record of {size} bytes (key, value and headers) is larger than the producer's "
                             f"whole buffer, buffer_memory={self.buffer_memory}")
        if self.max_request_size is not None and size > self.max_request_size:
            raise ValueError(f"a record of {size} bytes (key, value and headers) is larger than "
                             f"max_request_size={self.max_request_size}")

    def _wait_for_room(self, size: int, deadline: float) -> None:
        """Wait (the lock held) until ``size`` more bytes fit in the buffer; KafkaTimeout at ``deadline``.

        Meanwhile every queued batch is due, lingering or not: room comes only from acknowledgements.
        Sends that wait get room in the order they came (as Kafka's buffer pool gives it), so a large
        record is not overtaken until ``max_block_ms`` by a stream of small ones."""
        if self._closing:
            raise KafkaError("producer is closed")
        if not self._room_waiters and self._queued_bytes + size <= self.buffer_memory:
            return
        ticket = object()
        self._room_waiters.append(ticket)
        try:
            self._cond.notify_all()  # the sender: every queued batch is due now
            while self._room_waiters[0] is not ticket or self._queued_bytes + size > self.buffer_memory:
                if self._closing:
                    raise KafkaError("producer is closed")
                if not self._sender.is_alive():
                    raise KafkaError("the producer's sender thread has stopped (producer closed?)")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KafkaTimeout(f"the producer's buffer had no room for this send for max_block_ms "
                                       f"({self.max_block_s * 1000:.0f} ms): {self._queued_bytes} of "
                                       f"buffer_memory={self.buffer_memory} bytes queued and not yet "
                                       "acknowledged (is the broker reachable?)")
                self._cond.wait(min(remaining, 0.5))
        finally:
            self._room_waiters.remove(ticket)
            self._cond.notify_all()  # the next in line may fit now
        if self.transactional_id is not None:  # a commit or abort may have run while this waited
            self._txn.require(TxnState.IN_TRANSACTION, action="send")

    def _append(self, topic: str, partition: int, record: tuple, size: int) -> bool:
        """Add a record to the partition's open batch, starting one if there is none or it would overflow
        (the lock held); True if the sender needs waking: a batch's linger clock started or it filled up,
        which is not the case for most records."""
        queue = self._queues.get((topic, partition))
        if queue is None:
            queue = self._queues[(topic, partition)] = collections.deque()
        wake = not queue or queue[-1].closed or queue[-1].size + size > self.batch_size
        if wake:
            if queue and not queue[-1].closed:
                queue[-1].closed = True
            queue.append(_Batch(topic, partition, time.monotonic()))
        batch = queue[-1]
        batch.records.append(record)
        batch.size += size
        self._queued_bytes += size
        if batch.size >= self.batch_size:
            batch.closed = wake = True
        return wake

    def _hand_over_new_partitions(self) -> None:
        """If records wait for a partition the open transaction lacks and the sender is idle, wait until
        it woke (the lock held): it needs the GIL to send AddPartitionsToTxn during the linger, and a
        caller sending in a loop would otherwise hold it for the interpreter's switch interval (5 ms)."""
        # Waiting for the count to move, not for the flag to clear: a sender whose round trip ended before
        # this thread got the lock back is waiting again, and nothing would wake this one before the timeout.
        if self._sender_waiting and self._partitions_to_add():
            woke = self._sender_wakeups
            if not self._cond.wait_for(lambda: self._sender_wakeups != woke, timeout=HAND_OVER_TIMEOUT_S):
                log.warning("the producer's sender did not wake within %.1f s to add partitions to the "
                            "transaction", HAND_OVER_TIMEOUT_S)

    def flush(self, timeout_s: float | None = None) -> None:
        """Send everything queued and wait for it; raises the first error of a failed send."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.delivery_timeout_s + 5)
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while any(self._queues.values()):
                    if not self._sender.is_alive():
                        raise KafkaError("the producer's sender thread has stopped (producer closed?)")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise KafkaTimeout("flush did not complete in time")
                    self._cond.wait(min(remaining, 0.5))
            finally:
                self._flushing -= 1
        self._raise_errors()

    def _raise_errors(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            if any(isinstance(e, ProducerFenced) for e in errors):
                self._txn.transition(TxnState.FATAL_ERROR)
            elif self._txn.state is TxnState.IN_TRANSACTION:
                self._txn.transition(TxnState.ABORTABLE_ERROR)
            raise errors[0]

    # --- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    batches = self._ready_batches(now)
                    adding = self._partitions_to_add()
                    if batches or adding or (self._closing and not any(self._queues.values())):
                        break
                    self._sender_waiting = True
                    try:
                        self._cond.wait(self._next_wakeup(now))
                    finally:
                        self._sender_waiting = False
                        self._sender_wakeups += 1
                    self._cond.notify_all()  # a caller may wait for this (_hand_over_new_partitions)
            if not batches and not adding:
                return
            try:
                self._send(batches, adding)
            except Exception as exc:  # a bug must not leave flush() waiting forever
                log.exception("producer sender failed")
                self._fail_heads(batches, adding, KafkaError(f"sender failed: {type(exc).__name__}: {exc}"))
            with self._cond:
                self._cond.notify_all()

    def _ready_batches(self, now: float) -> list[_Batch]:
        """Each partition's due batches from its head on, at most ``max_in_flight``, in queue order: full,
        lingered, or flushed. A batch waiting to be retried holds back those behind it."""
        hurry = self._all_due()
        ready = []
        for queue in self._queues.values():
            for batch in itertools.islice(queue, self.max_in_flight):
                if not (batch.closed or hurry or now - batch.created >= self.linger_s) or batch.retry_at > now:
                    break
                if not batch.closed:
                    batch.closed = True
                    self._sticky.batch_sent(batch.topic, batch.partition)
                ready.append(batch)
        return ready

    def _partitions_to_add(self) -> list[tuple[str, int]]:
        """The partitions with queued records that the open transaction does not hold yet (the lock held).

        Added as soon as their first record is queued, as Java's producer does, not once a batch is due:
        AddPartitionsToTxn (a round trip and a transaction-log fsync) runs during the linger, and the
        first batch of a transaction goes out when its linger ends, not a round trip later."""
        if self.transactional_id is None:
            return []
        return sorted(key for key, queue in self._queues.items() if queue and key not in self._txn_partitions)

    def _all_due(self) -> bool:
        """Every queued batch is due, lingering or not: a flush, a close, or a send waiting for room."""
        return bool(self._flushing or self._closing or self._room_waiters)

    def _next_wakeup(self, now: float) -> float | None:
        """Seconds until a partition's head batch is due (its retry time, and its linger unless it is full
        or everything is due now), None if nothing is queued."""
        hurry = self._all_due()
        times = [(q[0].retry_at if hurry or q[0].closed else max(q[0].retry_at, q[0].created + self.linger_s)) - now
                 for q in self._queues.values() if q]
        return max(0.001, min(times)) if times else None

    def _fail(self, batch: _Batch, error: KafkaError) -> None:
        """Drop a still pending batch for good and report ``error``.

        A batch that was sent used its sequence numbers, so the partition's batches sent after it (in the
        same pipelines) are dropped with it: the broker may have written any of them, and sealing one
        again under a new producer id or epoch could write it twice. Batches never sent are sealed later
        under the new id (idempotent) or after the abort (transactional); batches of other partitions
        keep their producer id and sequences, so the broker still deduplicates them."""
        with self._cond:
            queue = self._queues[(batch.topic, batch.partition)]
            if not queue or queue[0] is not batch:
                return  # acknowledged before the sender failed
            self._errors.append(error)
            sent = batch.wire is not None
            while queue and (queue[0] is batch or sent and queue[0].wire is not None):
                dropped = queue[0]
                log.warning("dropping %d records for %s-%d: %s", len(dropped.records), dropped.topic,
                            dropped.partition, error)
                self._dequeue(queue)
            if sent:  # later batches would leave a gap in the sequence
                if self.transactional_id is None:
                    self._producer_id = -1  # a new producer id restarts every sequence at 0
                else:
                    self._sequence_gap = True  # a new epoch after the abort restarts them

    def _dequeue(self, queue: collections.deque[_Batch]) -> None:
        """Take a partition's head batch off its queue (the lock held), freeing its room in the buffer."""
        self._queued_bytes -= queue.popleft().size
        if self._room_waiters:
            self._cond.notify_all()

    def _send(self, batches: list[_Batch], adding: list[tuple[str, int]]) -> None:
        """Add ``adding`` to the transaction, then produce ``batches`` (due batches, possibly none)."""
        try:
            if self._producer_id < 0:
                self._init_producer_id()
            if adding:
                self._add_partitions(adding)
        except KafkaError as exc:
            self._fail_heads(batches, adding, exc)
            return
        by_leader: dict[int, list[_Batch]] = collections.defaultdict(list)
        leaders: dict[tuple[str, int], int | None] = {}
        for batch in batches:  # each partition's head first
            key = (batch.topic, batch.partition)
            if key not in leaders:
                try:
                    leaders[key] = self._cluster.leader(*key)
                except KafkaError as exc:
                    leaders[key] = None
                    self._retry_later(batch, exc)  # the head: the partition's other batches wait behind it
            if leaders[key] is not None:
                by_leader[leaders[key]].append(batch)
        for node, group in by_leader.items():
            self._produce(node, group)

    def _fail_heads(self, batches: list[_Batch], adding: list[tuple[str, int]], error: KafkaError) -> None:
        """Fail ``batches`` and the head batch of each partition of ``adding``, due or not (a partition
        the transaction could not add: its next batch tries again)."""
        with self._cond:
            heads: dict[tuple[str, int], _Batch] = {}
            for b in batches:
                heads.setdefault((b.topic, b.partition), b)  # a partition's first: its head
            heads.update((key, self._queues[key][0]) for key in adding if self._queues[key])
        for batch in heads.values():
            self._fail(batch, error)

    def _retry_later(self, batch: _Batch, error: KafkaError) -> None:
        batch.attempts += 1
        if (not error.retriable or time.monotonic() - batch.created > self.delivery_timeout_s
                or (self.retries is not None and batch.attempts > self.retries)):
            self._fail(batch, error)
            return
        log.info("retrying %s-%d: %s", batch.topic, batch.partition, error)
        self._cluster.invalidate(batch.topic)
        batch.retry_at = time.monotonic() + min(1.0, 0.05 * 2 ** batch.attempts)

    def _encode(self, batch: _Batch) -> bytes:
        if batch.wire is None:
            key = (batch.topic, batch.partition)
            sequence = self._sequences[key]
            unsealed = batch.unsealed if batch.unsealed is not None else unsealed_batch(batch.records,
                                                                                        self._compression)
            batch.wire = seal_batch(unsealed, producer_id=self._producer_id, producer_epoch=self._producer_epoch,
                                    base_sequence=sequence, transactional=self.transactional_id is not None)
            batch.unsealed = None
            self._sequences[key] = (sequence + len(batch.records)) % (INT32_MAX + 1)
        return batch.wire

    def _encode_ahead(self) -> None:
        """During a pipeline of Produce requests: encode the full batches that the next one will carry
        (up to ``max_in_flight`` per partition), so that the sender's CPU work overlaps the broker's
        instead of following it (the flush before a commit is the sender alone). Only the records:
        producer id, epoch and sequence are set when a batch is sent."""
        with self._cond:
            unsent = (itertools.islice((b for b in queue if b.wire is None), self.max_in_flight)
                      for queue in self._queues.values())
            ahead = [b for b in itertools.chain.from_iterable(unsent) if b.closed and b.unsealed is None]
        for batch in ahead:
            try:
                batch.unsealed = unsealed_batch(batch.records, self._compression)
            except Exception as exc:  # sent as usual, the same error then fails the batch
                log.warning("could not encode a batch for %s-%d ahead: %s", batch.topic, batch.partition, exc)

    def _produce(self, node: int, batches: list[_Batch]) -> None:
        """Send ``batches`` (in queue order per partition) to ``node`` pipelined, request *i* carrying each
        partition's *i*-th, and settle them in order: acknowledged ones leave their queue; at a partition's
        first failure that batch is retried later and the partition's later ones wait behind it (sent
        after it, any of them the broker already wrote is answered as a duplicate)."""
        waves: list[list[_Batch]] = []
        taken: collections.Counter[tuple[str, int]] = collections.Counter()
        for b in batches:
            i = taken[(b.topic, b.partition)]
            taken[(b.topic, b.partition)] += 1
            if i == len(waves):
                waves.append([])
            waves[i].append(b)
        unencodable: list[tuple[_Batch, Exception]] = []

        def requests(v: int):
            for wave in waves:
                try:
                    request = self._produce_request(v, wave)
                except _Unencodable as exc:  # the pipeline ends before this wave
                    unencodable.append(exc.args)
                    return
                yield request

        try:
            if self._producer_id < 0:  # a batch dropped while another broker's batches were settled
                self._init_producer_id()
            conn = self._cluster.connection(node)
            responses = conn.request_many(requests(conn.version(ApiKey.PRODUCE, 9, 3)),
                                          while_waiting=self._encode_ahead)
        except KafkaError as exc:
            for b in waves[0]:
                self._retry_later(b, exc)
            return
        failed: set[tuple[str, int]] = set()
        for wave, response in zip(waves[:len(responses)], responses, strict=True):
            results = {(t.name, int(p.index)): p for t in response.responses for p in t.partition_responses}
            for b in wave:
                key = (b.topic, b.partition)
                if key in failed:
                    continue  # sent again after the batch before it
                result = results.get(key)
                code = result.error_code if result is not None else ErrorCode.unknown_server_error
                if code in (ErrorCode.none, ErrorCode.duplicate_sequence_number):
                    with self._cond:
                        self._dequeue(self._queues[key])
                else:
                    failed.add(key)
                    self._retry_later(b, error_for(code, f"Produce to {b.topic}-{b.partition}"))
        for b, cause in unencodable:  # unless batches before it wait to be sent again
            self._fail(b, KafkaError(f"cannot encode a batch for {b.topic}-{b.partition}: "
                                     f"{type(cause).__name__}: {cause}"))

    def _produce_request(self, v: int, wave: list[_Batch]):
        """One Produce request carrying ``wave`` (one batch per partition), sealed now."""
        topics: dict[str, list] = collections.defaultdict(list)
        for b in wave:
            try:
                records = self._encode(b)
            except Exception as exc:
                raise _Unencodable(b, exc) from exc
            topics[b.topic].append(part(ApiKey.PRODUCE, v, "PartitionProduceData", index=b.partition,
                                        records=records))
        return message(ApiKey.PRODUCE, v, transactional_id=self.transactional_id, acks=-1,
                       timeout=int(self.request_timeout_s * 1000) * MS,
                       topic_data=tuple(part(ApiKey.PRODUCE, v, "TopicProduceData", name=t,
                                             partition_data=tuple(ps)) for t, ps in topics.items()))

    # --- producer id and transactions ---------------------------------------------------------

    def _txn_coordinator_call(self, call, what: str):
        return self._cluster.coordinator_call(self.transactional_id, CoordinatorType.TRANSACTION, call,
                                              self.request_timeout_s, what)

    def _init_producer_id(self):
        """InitProducerId: a new id (idempotent) or the transactional id's next epoch (fencing older ones)."""
        def call(conn: Connection):
            return init_producer_id(conn, self.transactional_id, self.transaction_timeout_ms,
                                    enable_2pc=self.enable_2pc)

        if self.transactional_id is None:
            response = self._retry_any(call, "InitProducerId")
        else:
            response = self._txn_coordinator_call(call, f"InitProducerId({self.transactional_id!r})")
        self._producer_id, self._producer_epoch = int(response.producer_id), int(response.producer_epoch)
        self._sequences.clear()
        return response

    def _retry_any(self, call, what: str):
        return retry(lambda: call(self._cluster.any_connection()), self.request_timeout_s, what)

    def _add_partitions(self, new: list[tuple[str, int]]) -> None:
        by_topic: dict[str, list[int]] = collections.defaultdict(list)
        for topic, partition in new:
            by_topic[topic].append(partition)

        def call(conn: Connection) -> None:
            v = conn.version(ApiKey.ADD_PARTITIONS_TO_TXN, 3)
            topics = tuple(part(ApiKey.ADD_PARTITIONS_TO_TXN, v, "AddPartitionsToTxnTopic", name=t,
                                partitions=tuple(ps)) for t, ps in by_topic.items())
            response = conn.request(message(
                ApiKey.ADD_PARTITIONS_TO_TXN, v, v3_and_below_transactional_id=self.transactional_id,
                v3_and_below_producer_id=self._producer_id, v3_and_below_producer_epoch=self._producer_epoch,
                v3_and_below_topics=topics))
            for t in response.results_by_topic_v3_and_below:
                for p in t.results_by_partition:
                    check(p.partition_error_code, f"AddPartitionsToTxn({t.name}-{p.partition_index})")

        self._txn_coordinator_call(call, "AddPartitionsToTxn")
        self._txn_partitions.update(new)

    def init_transactions(self) -> None:
        """Register the transactional id: fences older instances and aborts what they left open
        (a prepared 2PC transaction too: use :meth:`complete_prepared` to keep one)."""
        if self.transactional_id is None:
            raise TransactionStateError("init_transactions needs a transactional_id")
        self._txn.require(TxnState.UNINITIALIZED, action="init_transactions")
        self._guard(self._init_producer_id)
        self._txn.transition(TxnState.READY)

    def begin_transaction(self) -> None:
        """Open a transaction: records sent from now on are committed or aborted together."""
        self._txn.require(TxnState.READY, action="begin_transaction")
        self._txn.transition(TxnState.IN_TRANSACTION)

    def prepare_transaction(self) -> PreparedTxn:
        """Flush and hand out what another process needs to finish this transaction.

        With ``enable_2pc`` (KIP-939) the transaction never times out; finish it with
        :meth:`complete_prepared`. Without, it is an ordinary transaction that the broker aborts once
        ``transaction_timeout_ms`` passes; finish it before then with :meth:`complete_flushed`.
        """
        self._txn.require(TxnState.IN_TRANSACTION, action="prepare_transaction")
        self.flush()
        self._txn.transition(TxnState.PREPARED)
        return PreparedTxn(self.transactional_id, self._producer_id, self._producer_epoch)

    def commit_transaction(self) -> None:
        """Flush and commit. After a KafkaTimeout (coordinator unreachable) it may be called again."""
        self._txn.require(TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.COMMITTING,
                          action="commit_transaction")
        if self._txn.state is not TxnState.COMMITTING:
            self.flush()
            self._txn.transition(TxnState.COMMITTING)
        self._end_transaction(commit=True)

    def abort_transaction(self) -> None:
        """Abort the open transaction; queued records are still sent first (and then aborted).
        After a KafkaTimeout it may be called again."""
        self._txn.require(TxnState.IN_TRANSACTION, TxnState.PREPARED, TxnState.ABORTABLE_ERROR, TxnState.ABORTING,
                          action="abort_transaction")
        if self._txn.state is not TxnState.ABORTING:
            self._txn.transition(TxnState.ABORTING)
        try:
            self.flush()
        except ProducerFenced:
            raise
        except KafkaError as exc:
            log.info("aborting %s after a failed send: %s", self.transactional_id, exc)
        self._end_transaction(commit=False)
        if self._sequence_gap:
            self._guard(self._init_producer_id)  # a new epoch: sequences start at 0 again
            self._sequence_gap = False

    def _end_transaction(self, commit: bool) -> None:
        if self._txn_partitions:  # nothing was added: the coordinator has no transaction to end
            self._guard(lambda: self._send_end_txn(commit))
        self._txn_partitions.clear()
        self._txn.transition(TxnState.READY)

    def _send_end_txn(self, commit: bool) -> None:
        def call(conn: Connection) -> None:
            v = conn.version(ApiKey.END_TXN, 5)
            response = conn.request(message(ApiKey.END_TXN, v, transactional_id=self.transactional_id,
                                            producer_id=self._producer_id,
                                            producer_epoch=self._producer_epoch, committed=commit))
            check(response.error_code, f"EndTxn({'commit' if commit else 'abort'})")

        self._txn_coordinator_call(call, "EndTxn")

    def _guard(self, action):
        """Run a transactional request; fencing makes the producer fatally failed."""
        try:
            return action()
        except ProducerFenced:
            self._txn.transition(TxnState.FATAL_ERROR)
            raise

    @staticmethod
    def complete_prepared(bootstrap: str, handle: PreparedTxn, commit: bool, *, request_timeout_ms: int = 30_000,
                          security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
        """Commit or abort the prepared transaction ``handle`` from any process; idempotent. See
        :func:`twophase.client.prepared.complete_prepared`."""
        complete_prepared(bootstrap, handle, commit, request_timeout_ms=request_timeout_ms, security=security)

    @staticmethod
    def complete_flushed(bootstrap: str, handle: PreparedTxn, commit: bool, *, request_timeout_ms: int = 30_000,
                         security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
        """Commit or abort the flushed ordinary transaction ``handle`` from any process; idempotent. See
        :func:`twophase.client.flushed.complete_flushed`."""
        complete_flushed(bootstrap, handle, commit, request_timeout_ms=request_timeout_ms, security=security)

    # --- closing ------------------------------------------------------------------------------

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued (within ``timeout_s``) and stop. An open transaction stays open on the
        broker until it times out (or, with 2PC, until someone completes or aborts it)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._sender.join(timeout_s if timeout_s is not None else self.delivery_timeout_s + 5)
        self._cluster.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

