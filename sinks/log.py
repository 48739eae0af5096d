"""Exactly-once records on a Kafka log: a TwoPhaseCommitSink over Kafka transactions.

Each Spark task attempt writes its rows into a Kafka transaction of its own,
under the transactional id of its slot (framework-assigned, unique among the
attempts alive at once, reused once an attempt is finished: the broker keeps a
bounded number of ids), so no two live attempts fence each other.
pre_commit flushes the transaction: its records are durable on the broker and
invisible to read_committed consumers. The handle is plain data (bootstrap
servers, transactional id, producer id and epoch); the coordinator's process
commits or aborts it, after Spark durably completed the micro-batch.

Transactional ids are named by slot: ``<prefix>.<app>.<query>.<partition>.<slot>``.
The framework gives each attempt a slot unique among the unsettled attempts of
its partition (:mod:`coordinator.slots`) and reuses it once the holder's
transaction is complete and ``CommitPolicy.slot_release_lag`` more epochs are
committed, so the broker keeps O(partitions x epochs in flight) transactional
ids, not one per attempt ever run (what FLIP-511 did for Flink's Kafka sink).
The next holder's InitProducerId (without keep_prepared_txn, in either mode)
aborts whatever an earlier holder left open and bumps the epoch, which fences
any zombie of an earlier holder. (Without a slot, a sink driven directly, the
id is per attempt: ``<prefix>.<app>.<query>.<run>.<epoch>.<partition>.<attempt>``.)
One race remains: an attempt paused between claiming its slot (the task's
``open``) and its InitProducerId (in ``begin_transaction``) for longer than its
epoch takes to settle without it plus ``slot_release_lag`` later commits can,
on resuming, fence the slot's next holder. That holder's task then fails
before its pre-commit (Spark retries it), or its commit fails loudly
(CommitFailed: the epoch is FAILED, see docs/sink-contract.md); never silently.

Usage::

    from sinks.log import LogSink
    from twophase.spark import TwoPhaseSink

    sink = LogSink("127.0.0.1:9092", "orders-out", key="order_id", value=None,   # value: JSON of the row
                   headers={"source": "orders"}, provenance=True)
    (df.writeStream
       .foreach(TwoPhaseSink(sink, app="orders", zk="127.0.0.1:2181"))
       .option("checkpointLocation", "/data/orders-checkpoint")
       .start())

Any read_committed consumer (confluent-kafka ``isolation.level=read_committed``,
the default there) then sees every row exactly once.

With ``columns="kafka"`` the rows are what Spark's own Kafka sink takes (sinks/log_columns.py):
``value`` (string or binary), optional ``key``, ``topic`` (per row; the sink's ``topic``, if set,
overrides it as Spark's ``topic`` option does), ``partition``, ``headers`` and ``timestamp``. One
transaction then spans every topic and partition the attempt's rows name, committed or aborted
together. Kafka's producer settings translate with sinks/log_settings.py::

    from sinks.log_settings import log_sink_args

    sink = LogSink("127.0.0.1:9092", columns="kafka", **log_sink_args({"linger.ms": "20"}))
    out = df.selectExpr("CAST(id AS STRING) AS key", "to_json(struct(*)) AS value",
                        "IF(id % 10 = 0, 'audit', 'orders') AS topic")

``write_batch`` (the Arrow path) builds the records a column at a time and hands them to the
producer in bulk (``Producer.send_many``); ``write`` (``foreach``) takes one row, with the same
columns and rules.

Two commit modes (sinks/log_modes.py; docs/log-sink.md has the whole story):

- ``prepared`` (KIP-939; the built-in broker): pre_commit *prepares* the
  transaction, which then never times out; commit takes it over as a new
  producer instance (InitProducerId with keep_prepared_txn) and ends it. An
  epoch whose commit waits for a driver restart, a coordinator failover or a
  broker restart is still committed. No Apache Kafka release ships KIP-939
  (taken out before 4.1, 4.2, 4.3 and 4.4: apache/kafka pull requests 19985,
  21159, 21902, 23356; KAFKA-20739).
- ``classic`` (every Kafka release): an ordinary transaction opened with the
  longest timeout the broker allows (its transaction.max.timeout.ms, 15 minutes
  by default), committed with EndTxn and the handle's producer id and epoch,
  as Flink's KafkaSink does through reflection. Exactly once as long as the
  commit comes within the timeout. A commit that comes later finds the
  transaction aborted by the broker: CommitFailed, saying which transaction,
  how old and which timeout; the epoch becomes FAILED and ``twophase status``
  shows it, never a silent loss (Flink's sink loses such data silently), and
  ``twophase replay`` runs the epoch again where that is exactly once.

``commit_mode="auto"`` (the default) picks ``prepared`` where the broker offers
it and ``classic`` otherwise.

Attempts that died without closing (a SIGKILLed driver takes its tasks along)
leave transactions open, holding back the last stable offset, so read_committed
consumers stall behind them (a prepared one forever). The coordinator calls
:meth:`LogSink.abort_unregistered` for each of them once their epoch is
settled; a new instance of the attempt's transactional id aborts whatever it
left open.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from kio.schema.errors import ErrorCode

from twophase.client import Admin, KafkaError, PreparedTxn, PreparedTxnLost, Producer, TransactionUnknown
from twophase.client.producer import OutRecord
from twophase.client.security import as_security, secrets_in
from twophase.sink import (AbortFailed, CommitFailed, CommitOutcomeUnknown, Record, RecordBatchLike,
                           TwoPhaseCommitSink, TxnContext)
from twophase.wire.compression import codec_id

from .log_columns import kafka_record, kafka_records, validate_kafka_schema
from .log_modes import COMMIT_MODES, BrokerModes, CommitMode, aborted_in_words, is_without_two_phase

Extractor = Union[str, Callable[[Any], Any], None]
Headers = Union[Mapping[str, Any], Iterable[tuple[str, Any]], Callable[[Any], Iterable[tuple[str, Any]]], None]

Columns = Literal["extract", "kafka"]

MAX_TRANSACTIONAL_ID = 249   # like topic names; Kafka itself stores ids as int16-length strings
_MAX_HEAD = 160              # prefix.app.query, leaving room for run, epoch, partition, attempt
_PREFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_modes = BrokerModes()  # per process (a Spark Python worker serves many tasks)


@dataclass(frozen=True)
class LogHandle:
    """A pre-committed transaction: everything commit and abort need, in any process.

    ``mode`` says how it was pre-committed ("prepared": KIP-939; "classic": flushed, committed by
    EndTxn before ``timeout_ms`` from ``opened_at`` passes).
    """

    bootstrap: str
    transactional_id: str
    prepared: str | None  # PreparedTxn.to_json(); None if the attempt wrote nothing
    records: int
    mode: str = "prepared"
    opened_at: float | None = None  # classic: when the transaction began (seconds since the epoch)
    timeout_ms: int | None = None   # classic: its transaction timeout
    security: str | dict[str, str] | None = None  # where the TLS/SASL settings come from; never a password


@dataclass
class LogTxn:
    """One attempt's open Kafka transaction (its producer opens at begin with a slot, else at the first row)."""

    ctx: TxnContext
    transactional_id: str
    producer: Producer | None = None   # opened at begin with a slot, else on the first row
    mode: str | None = None            # "prepared" or "classic", once the producer is open
    opened_at: float | None = None
    records: int = 0
    provenance: list[tuple[str, bytes]] = field(default_factory=list)


def transactional_id(prefix: str, ctx: TxnContext) -> str:
    """``<prefix>.<app>.<query>.<partition>.<slot>``, shared in turn by the attempts holding the slot;
    without a slot ``<prefix>.<app>.<query>.<run>.<epoch>.<partition>.<attempt>``, unique per attempt.

    The query is part of it so that two queries of one app never share an id.
    A head too long for Kafka's limits is replaced by a digest.
    """
    head = f"{prefix}.{ctx.app}.{ctx.query_id}"
    if len(head) > _MAX_HEAD:
        head = f"{prefix}.{hashlib.sha256(head.encode()).hexdigest()[:32]}"
    if ctx.slot is not None:
        return f"{head}.{ctx.partition}.{ctx.slot}"  # within the limit: the head is at most _MAX_HEAD
    tid = f"{head}.{ctx.run_id}.{ctx.epoch}.{ctx.partition}.{ctx.attempt}"
    if len(tid) > MAX_TRANSACTIONAL_ID:
        raise ValueError(f"transactional id {tid!r} is longer than {MAX_TRANSACTIONAL_ID}: run id too long")
    return tid


def _complete(handle: LogHandle, txn: PreparedTxn, commit: bool) -> None:
    if handle.mode == "classic":
        Producer.complete_flushed(handle.bootstrap, txn, commit=commit, security=handle.security)
    else:
        Producer.complete_prepared(handle.bootstrap, txn, commit=commit, security=handle.security)


def _to_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return json.dumps(value, default=str, separators=(",", ":")).encode("utf-8")


def _row_dict(row: Any) -> Any:
    if hasattr(row, "asDict"):
        return row.asDict(recursive=True)
    return row


def _extract(extractor: Extractor, row: Any) -> Any:
    if extractor is None:
        return None
    if callable(extractor):
        return extractor(row)
    return row[extractor]


class LogSink(TwoPhaseCommitSink):
    """Writes each row as one record to ``topic`` in a Kafka transaction per task attempt, committed by the coordinator.

    Example (Spark's Kafka sink columns; see the module docstring for ``key=``/``value=`` extractors)::

        sink = LogSink("127.0.0.1:9092", "orders", columns="kafka")  # rows: value, key, topic, partition, ...

    Args:
        bootstrap: the brokers, "host:port[,host:port...]".
        topic: where the records go; with ``columns="kafka"`` optional, and if given it overrides
            the rows' ``topic`` column (Spark's ``topic`` option).
        columns: "extract" (the default): each row becomes one record through ``key``, ``value``
            and ``headers``. "kafka": rows are Spark Kafka sink rows (sinks/log_columns.py), and
            ``key``, ``value``, ``serializer`` and ``headers`` must not be given.
        key: a column name or a callable on the row giving the record key (None: no key,
            so the client's partitioner spreads records).
        value: a column name or a callable; None means the whole row as JSON.
        serializer: turns the extracted value into bytes; by default bytes stay, str is
            UTF-8, anything else (dicts, Spark Rows as dicts, numbers) becomes JSON.
            The key always goes through the default rule.
        headers: static headers (a mapping or (name, value) pairs) or a callable on the row
            returning pairs; values become bytes by the default rule.
        provenance: add headers twophase.app / .run / .epoch / .partition / .attempt.
        transactional_id_prefix: first part of every transactional id this sink makes.
        producer: further twophase.client.Producer settings (linger_ms, batch_size, retries, ...).
        commit_mode: "auto" (KIP-939 where the broker offers it, else classic), "prepared" (KIP-939
            only: refuses a broker without it) or "classic" (ordinary transactions committed with
            EndTxn within their timeout); see sinks/log_modes.py and docs/log-sink.md.
        transaction_timeout_ms: classic mode's transaction timeout; None means the longest the broker
            allows (its transaction.max.timeout.ms).
        security: TLS and SASL settings under Kafka's names (docs/security.md): a source,
            "file:/etc/twophase/client.properties" or "env:KAFKA_" (KAFKA_SASL_PASSWORD, ...), read
            where a producer opens (executors, the coordinator's process), or a mapping without
            passwords. The sink is stored in ZooKeeper and its handles too: they name the source,
            never a secret.
    """

    commit_concurrency = 8  # each commit is its own producer instance and connection

    def __init__(self, bootstrap: str, topic: str | None = None, *, columns: Columns = "extract",
                 key: Extractor = None, value: Extractor = None,
                 serializer: Callable[[Any], bytes] | None = None, headers: Headers = None,
                 provenance: bool = False, transactional_id_prefix: str = "twophase",
                 producer: Mapping[str, Any] | None = None, commit_mode: CommitMode = "auto",
                 transaction_timeout_ms: int | None = None, security: str | Mapping[str, str] | None = None) -> None:
        if not bootstrap:
            raise ValueError("bootstrap servers are required")
        if columns not in ("extract", "kafka"):
            raise ValueError(f"columns must be 'extract' or 'kafka', not {columns!r}")
        if columns == "kafka":
            given = [name for name, v in (("key", key), ("value", value), ("serializer", serializer),
                                          ("headers", headers)) if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: with columns='kafka' the rows' own key, value and headers "
                                 "columns are written")
            if topic is not None and not (isinstance(topic, str) and topic):
                raise ValueError(f"topic must be a topic name or None, not {topic!r}")
        elif not topic:
            raise ValueError("topic is required (or columns='kafka' with a topic column)")
        if not _PREFIX.match(transactional_id_prefix):
            raise ValueError(f"transactional_id_prefix {transactional_id_prefix!r}: "
                             "1-64 letters, digits, '_' or '-'")
        for name, extractor in (("key", key), ("value", value)):
            if extractor is not None and not (callable(extractor) or isinstance(extractor, str)):
                raise TypeError(f"{name} must be a column name, a callable or None")
        if commit_mode not in COMMIT_MODES:
            raise ValueError(f"commit_mode must be one of {', '.join(COMMIT_MODES)}, not {commit_mode!r}")
        if transaction_timeout_ms is not None and (isinstance(transaction_timeout_ms, bool) or not isinstance(
                transaction_timeout_ms, int) or transaction_timeout_ms < 1):
            raise ValueError(f"transaction_timeout_ms must be a positive number of ms, not {transaction_timeout_ms!r}")
        if isinstance(security, Mapping):
            secrets = secrets_in(security)
            if secrets:
                raise ValueError(f"security settings {secrets} are secrets, and the sink is stored in ZooKeeper: "
                                 "give security='file:PATH' or 'env:PREFIX' (docs/security.md)")
            security = dict(security)
        as_security(security)  # ValueError naming a bad setting, or an unreadable source, here on the driver
        reserved = {"transactional_id", "enable_2pc", "transaction_timeout_ms", "security"} & set(producer or {})
        if reserved:
            raise ValueError(f"producer settings {sorted(reserved)} are the sink's to choose")
        # Checked here, on the driver: the producer itself opens only in a task.
        unknown = set(producer or {}) - set(inspect.signature(Producer).parameters) - reserved
        if unknown:
            raise ValueError(f"unknown producer settings {sorted(unknown)} (twophase.client.Producer's "
                             "keyword arguments, e.g. linger_ms, batch_size, compression)")
        if (producer or {}).get("compression") is not None:
            codec_id(producer["compression"])  # ValueError naming the codecs
        self.bootstrap = bootstrap
        self.topic = topic
        self.columns = columns
        self.key = key
        self.value = value
        self.serializer = serializer or _to_bytes
        self.headers = headers
        self.provenance = provenance
        self.transactional_id_prefix = transactional_id_prefix
        self.producer_settings = dict(producer or {})
        self.commit_mode = commit_mode
        self.transaction_timeout_ms = transaction_timeout_ms
        self.security = security

    # -- task side ------------------------------------------------------------

    def begin_transaction(self, ctx: TxnContext) -> LogTxn:
        """Start a transaction with the attempt's transactional id.

        With a slot the producer opens here: its InitProducerId (without keep_prepared_txn) takes the
        slot's id over at once, aborting whatever an earlier holder left open and bumping the epoch,
        which fences that holder's zombies; and a zombie of this attempt has only the time from
        claiming the slot to here to fence a later holder (docs/sink-contract.md). Without a slot (a
        per-attempt id) it opens on the first row, so that empty partitions leave no id behind.
        """
        txn = LogTxn(ctx, transactional_id(self.transactional_id_prefix, ctx))
        if self.provenance:
            txn.provenance = [(f"twophase.{name}", str(getattr(ctx, name)).encode())
                              for name in ("app", "run_id", "epoch", "partition", "attempt")]
        if ctx.slot is not None:
            self._open_producer(txn)
        return txn

    def write(self, txn: LogTxn, row: Any) -> None:
        """Send one row inside the attempt's Kafka transaction."""
        topic, partition, key, value, headers, timestamp = self._record(row)
        self._started(txn).send(topic, value=value, key=key, partition=partition,
                                headers=(headers or []) + txn.provenance, timestamp_ms=timestamp)
        txn.records += 1

    def write_batch(self, txn: LogTxn, batch: RecordBatchLike) -> None:
        """Send the rows of an Arrow batch inside the attempt's Kafka transaction, in bulk.

        With ``columns="kafka"`` the records are built a column at a time (the schema checked first,
        with Spark's messages); otherwise each row goes through the extractors as a :class:`Record`.
        Either way the producer queues them with one call (``Producer.send_many``).
        """
        if batch.num_rows == 0:
            return
        if self.columns == "kafka":
            validate_kafka_schema(batch.schema, self.topic)
            records = kafka_records(batch, self.topic)
        else:
            records = [self._record(Record(row)) for row in batch.to_pylist()]
        if txn.provenance:
            records = [(t, p, k, v, (h or []) + txn.provenance, ts) for t, p, k, v, h, ts in records]
        txn.records += self._started(txn).send_many(records)

    def _record(self, row: Any) -> OutRecord:
        """The (topic, partition, key, value, headers, timestamp) record of one row."""
        if self.columns == "kafka":
            return kafka_record(row, self.topic)
        value = _extract(self.value, row) if self.value is not None else _row_dict(row)
        return self.topic, None, _to_bytes(_extract(self.key, row)), self.serializer(value), self._headers(row), None

    def _started(self, txn: LogTxn) -> Producer:
        """The attempt's producer, opened on the first row where it was not at begin."""
        if txn.producer is None:
            self._open_producer(txn)
        if txn.opened_at is None:
            txn.opened_at = time.time()  # the broker starts the transaction's clock at its first partition
        return txn.producer

    def pre_commit(self, txn: LogTxn) -> LogHandle:
        """Flush and prepare the Kafka transaction, close the producer; return the handle.

        The handle carries the prepared transaction (producer id and epoch) as
        JSON, or None if no row was written (the broker then has no transaction open).
        """
        if txn.records == 0:
            if txn.producer is not None:
                txn.producer.close()
                txn.producer = None
            return LogHandle(self.bootstrap, txn.transactional_id, None, 0, txn.mode or "prepared",
                             security=self.security)
        producer = txn.producer
        try:
            prepared = producer.prepare_transaction().to_json()
        finally:
            producer.close()
            txn.producer = None
        return LogHandle(self.bootstrap, txn.transactional_id, prepared, txn.records, txn.mode,
                         txn.opened_at if txn.mode == "classic" else None,
                         producer.transaction_timeout_ms if txn.mode == "classic" else None, self.security)

    def _open_producer(self, txn: LogTxn) -> None:
        """Open the attempt's transactional producer in the sink's commit mode (auto: the broker's)."""
        mode = self.commit_mode if self.commit_mode != "auto" else _modes.known(self.bootstrap) or "prepared"
        try:
            txn.producer = self._begin(txn.transactional_id, mode)
        except KafkaError as e:
            if self.commit_mode != "auto" or not is_without_two_phase(e):
                raise
            mode = "classic"  # the broker has no KIP-939: every Apache Kafka release
            txn.producer = self._begin(txn.transactional_id, mode)
        if self.commit_mode == "auto":
            _modes.learn(self.bootstrap, mode)
        txn.mode = mode

    def _begin(self, tid: str, mode: str) -> Producer:
        if mode == "prepared":
            producer = Producer(self.bootstrap, transactional_id=tid, enable_2pc=True, security=self.security,
                                **self.producer_settings)
        else:
            timeout = self.transaction_timeout_ms or _modes.max_timeout_ms(self.bootstrap, self.security)
            producer = Producer(self.bootstrap, transactional_id=tid, transaction_timeout_ms=timeout,
                                security=self.security, **self.producer_settings)
        try:
            producer.init_transactions()
            producer.begin_transaction()
        except KafkaError as e:
            producer.close()
            if e.code == ErrorCode.invalid_transaction_timeout:
                raise ValueError(f"broker {self.bootstrap} refused a transaction timeout of "
                                 f"{producer.transaction_timeout_ms} ms: set LogSink(transaction_timeout_ms=...) to "
                                 "at most its transaction.max.timeout.ms") from e
            raise
        except BaseException:
            producer.close()
            raise
        return producer

    def _headers(self, row: Any) -> list[tuple[str, bytes]]:
        headers = self.headers
        if headers is None:
            return []
        if callable(headers):
            headers = headers(row)
        elif isinstance(headers, Mapping):
            headers = headers.items()
        return [(name, _to_bytes(v)) for name, v in headers]

    # -- coordinator side ----------------------------------------------------

    def commit(self, handle: LogHandle) -> None:
        """Commit the prepared transaction from any process. Idempotent.

        Raises CommitFailed if the transaction was aborted or replaced by someone else.
        """
        if handle.prepared is None:
            return
        txn = PreparedTxn.from_json(handle.prepared)
        try:
            _complete(handle, txn, commit=True)
        except TransactionUnknown as e:
            raise CommitOutcomeUnknown(f"{handle.records} records of Kafka transaction {handle.transactional_id}: "
                                       f"{e}; check the topic before anything else (docs/log-sink.md)") from e
        except PreparedTxnLost as e:
            if handle.mode == "classic":
                raise CommitFailed(aborted_in_words(
                    handle.transactional_id, f"producer {txn.producer_id} epoch {txn.producer_epoch}",
                    handle.records, handle.opened_at, handle.timeout_ms) + f" [{e}]") from e
            raise CommitFailed(f"{handle.records} prepared records of {handle.transactional_id} "
                               f"are lost: {e}") from e

    def abort(self, handle: LogHandle) -> None:
        """Abort the prepared transaction; a no-op if it is gone already.

        Raises AbortFailed if the broker says it was committed.
        """
        if handle.prepared is None:
            return
        try:
            _complete(handle, PreparedTxn.from_json(handle.prepared), commit=False)
        except PreparedTxnLost:
            pass  # aborted or replaced already: gone either way
        except KafkaError as e:
            if e.code != ErrorCode.invalid_txn_state:
                raise
            raise AbortFailed(f"{handle.records} records of {handle.transactional_id} were committed "
                              f"already and cannot be aborted") from e

    def abort_transaction(self, txn: LogTxn) -> None:
        """Abort the open Kafka transaction of a failed task, if a producer was opened, and close it."""
        producer, txn.producer = txn.producer, None
        if producer is not None:
            try:
                producer.abort_transaction()
            finally:
                producer.close()

    def abort_unregistered(self, ctx: TxnContext) -> None:
        """End what a dead attempt left open (a new instance of its id without keep_prepared_txn).

        With a slot the id is always fenced, open transaction or not: the dead attempt's intent still
        holds the slot (it is released only once the intent is dropped), so the id is this attempt's
        alone, and the epoch bump also stops a zombie of it (a paused task, not a dead one) from
        preparing anything later. Without a slot (a per-attempt id) an id the broker never saw or one
        with nothing open is left alone, so cleaning up does not create transactional ids of its own.
        """
        tid = transactional_id(self.transactional_id_prefix, ctx)
        with Admin(self.bootstrap, security=self.security) as admin:
            if ctx.slot is not None:
                admin.abort_transaction(tid)
                return
            try:
                [described] = admin.describe_transactions([tid])
            except KafkaError as e:
                if e.code == ErrorCode.transactional_id_not_found:
                    return
                raise
            if described.state == "Ongoing":
                admin.abort_transaction(tid)
