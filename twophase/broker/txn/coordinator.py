"""The transaction coordinator (KIP-98, KIP-447 offsets, KIP-939 prepared transactions).

Maps each transactional id to its producer id, epoch, state, partitions and consumer groups,
and drives the two-phase completion: the decision (PrepareCommit/PrepareAbort) is fsynced to
the transaction log before any marker is written; then a commit or abort marker goes to every
partition of the transaction, pending group offsets are applied or discarded, and
CompleteCommit/CompleteAbort is logged. A broker that dies in between finishes the job in
:meth:`recover`. Under an fsync interval a marker is left to its partition's periodic flush, as
its data is: the log records it as unsynced until then, and :meth:`recover` writes again the ones
a crash lost (:mod:`.unsynced`). Every change is made to a copy of the id's metadata, logged, and
installed only once the log write succeeded, so memory is never ahead of the log (Complete* is
written without an fsync of its own: its loss leaves the Prepare*, which recovery completes
again); once a write failed, every request that could change or add to a transaction is refused
until a restart. It also knows which producer ids belong to transactional ids (Produce takes plain
batches only with ids issued for idempotence), and at start ends the transactions partitions hold
open that it does not (KIP-664 hanging transactions, :mod:`.hanging`). Handlers in
:mod:`twophase.broker.apis` translate wire messages to calls here; nothing here knows about kio.
All calls run on the broker's event loop thread. :class:`TransactionCoordinator` shows its use.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable

import re2

from twophase.wire.errors import KafkaError, UnknownTopicOrPartitionError

from ..group_commit import GroupCommit
from ..groups.offsets import CommittedOffset, OffsetStore
from .failpoints import Failpoint
from .hanging import HangingTransactions, OpenTxn
from .log import TransactionLog, TransactionLogFailed
from .metadata import TxnMetadata
from .state import TRANSITIONS, TxnState
from .unsynced import (
    MAX_UNSYNCED,
    UnsyncedMarker,
    record,
    restore,
    still_unsynced,
    sync_all,
)

log = logging.getLogger("twophase.broker.txn")

NONE = 0
UNKNOWN_TOPIC_OR_PARTITION = 3
# A failed transaction-log write: Kafka answers NOT_COORDINATOR or COORDINATOR_NOT_AVAILABLE; both make
# every client look the coordinator up again and retry. This single broker stays the coordinator, so
# "not available" (until a restart) is the true one.
COORDINATOR_NOT_AVAILABLE = 15
NOT_ENOUGH_REPLICAS = 19  # what Produce answers instead: every producer retries it, none knows 15 there
INVALID_REQUEST = 42
INVALID_PRODUCER_EPOCH = 47
INVALID_TXN_STATE = 48
INVALID_PRODUCER_ID_MAPPING = 49
INVALID_TRANSACTION_TIMEOUT = 50
CONCURRENT_TRANSACTIONS = 51
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
UNKNOWN_PRODUCER_ID = 59
PRODUCER_FENCED = 90
TRANSACTIONAL_ID_NOT_FOUND = 105
TRANSACTION_ABORTABLE = 120  # KIP-890: "abort, then this transactional id can go on"
INVALID_REGULAR_EXPRESSION = 128

COORDINATOR_EPOCH = 0  # one broker, never re-elected
COMPLETION_ERROR_LOG_INTERVAL_S = 60.0  # a completion retried every check logs its ERROR this often
HANGING_RETRY_MS = 60_000  # a failed abort of a hanging transaction (a partition offline) is retried this often
MAX_PATTERN_LENGTH = 1_000  # ListTransactions patterns run on the event loop: keep them small
# What one transaction may hold: with the longest topic names (249 characters) and group ids (32767
# characters, 6 bytes each in the worst JSON escape) its log record stays far below MAX_RECORD_BYTES.
MAX_PARTITIONS_PER_TXN = 10_000
MAX_GROUPS_PER_TXN = 16
_PATTERN_OPTIONS = re2.Options()
_PATTERN_OPTIONS.log_errors = False  # a client's bad pattern is its error, answered, not the broker's log noise


def _nothing() -> None:
    """An fsync of the transaction log makes nothing visible to readers."""


def _unavailable_when_the_log_fails(unavailable):
    """A request whose log write fails is answered ``unavailable`` (COORDINATOR_NOT_AVAILABLE), not by
    closing the client's connection; memory stayed at the last durable state."""
    def wrap(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except TransactionLogFailed:
                return unavailable
        return call
    return wrap


@dataclasses.dataclass(frozen=True)
class TxnSettings:
    """Kafka's transaction.max.timeout.ms, transactional.id.expiration.ms,
    transaction.abort.timed.out.transaction.cleanup.interval.ms and transaction.two.phase.commit.enable."""

    max_timeout_ms: int = 900_000
    id_expiration_ms: int = 7 * 24 * 3600 * 1000
    check_interval_ms: int = 10_000
    allow_two_phase: bool = True

    def __post_init__(self) -> None:
        for name in ("max_timeout_ms", "id_expiration_ms", "check_interval_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 ms")


@dataclasses.dataclass(frozen=True)
class InitResult:
    """The answer to InitProducerId: an error code, or the producer id and epoch (and a kept transaction's)."""
    error: int
    producer_id: int = -1
    producer_epoch: int = -1
    ongoing_producer_id: int = -1  # KIP-939: what the kept prepared transaction was written with
    ongoing_producer_epoch: int = -1


@dataclasses.dataclass(frozen=True)
class TxnDescription:
    """A transactional id as DescribeTransactions shows it: state, producer, timeout, start and partitions."""
    transactional_id: str
    state: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    start_ms: int
    partitions: tuple[tuple[str, int], ...]


class TransactionCoordinator:
    """The transaction coordinator: producer ids, epochs and the two-phase completion of every transactional id.

    State is kept in a TransactionLog under ``directory``; every change is
    logged (fsynced; Complete* only written) before it is installed in memory. Requests are answered
    with Kafka error codes (0 is NONE), not exceptions. Call it on the broker's
    event loop thread only; ``check`` is called periodically from there.

    Usage::

        txns = TransactionCoordinator("/data/transactions", partition_log=logs.partition,
                                      offsets=groups.offsets, allocate_producer_id=broker.allocate_producer_id,
                                      data_arrived=broker.data_arrived, settings=TxnSettings())
        txns.recover(now_ms)
        txns.resolve_open_transactions(open_transactions(logs.partitions()), now_ms)
        r = txns.init_producer_id("app-1", 60_000, now_ms=now_ms)
        txns.add_partitions("app-1", r.producer_id, r.producer_epoch, [("t", 0)], now_ms)
        txns.end_txn("app-1", r.producer_id, r.producer_epoch, commit=True, now_ms=now_ms)   # 0
        txns.describe("app-1").state                                                      # "CompleteCommit"
        txns.close()
    """
    def __init__(self, directory: str, *, partition_log: Callable, offsets: OffsetStore,
                 allocate_producer_id: Callable[[], int], data_arrived: Callable[[str, int], None],
                 settings: TxnSettings | None = None, failpoint: Failpoint | None = None,
                 producer_id_issued: Callable[[int], bool] | None = None,
                 group_commit: GroupCommit | None = None) -> None:
        """``partition_log(topic, partition)`` returns a PartitionLog or raises
        UnknownTopicOrPartitionError; ``data_arrived`` wakes read_committed long polls;
        ``producer_id_issued(id)`` says whether the allocator may have handed ``id`` out (None:
        any id >= 0, for a coordinator used without Produce); ``group_commit`` fsyncs lazy records of
        the transaction log off the event loop (the broker's, so that stopping drains it)."""
        self.settings = settings or TxnSettings()
        self._log = TransactionLog(directory)
        self._group_commit = group_commit or GroupCommit()
        # Transactional id -> the transaction-log record count its last AddPartitionsToTxn needs fsynced
        # before that transaction's data may be appended (see additions_durable).
        self._additions: dict[str, int] = {}
        self._partition_log = partition_log
        self._offsets = offsets
        self._allocate = allocate_producer_id
        self._data_arrived = data_arrived
        self._failpoint = failpoint or Failpoint(None)
        self._txns: dict[str, TxnMetadata] = {}
        self._issued = producer_id_issued or (lambda producer_id: producer_id >= 0)
        # Producer id -> the transactional id it belongs to (its current one, or its open transaction's):
        # such an id is for transactional batches of that id only.
        self._owners: dict[int, str] = {}
        self._hanging = HangingTransactions()  # found at start, outcome unknown: aborted at their deadline
        self._completion_errors: dict[str, float] = {}  # transactional id -> when its failure was last logged

    # -- lifecycle -------------------------------------------------------------------------------

    def recover(self, now_ms: int) -> None:
        """Replay the log; finish every transaction whose decision was logged but not completed."""
        for tid, value in self._log.open().items():
            self._txns[tid] = TxnMetadata.from_dict(tid, value)
            self._own(self._txns[tid])
        # First: a marker written now would end the transaction of a lost one with its own outcome.
        for meta in list(self._txns.values()):
            if meta.unsynced_markers:
                self._restore_markers(meta, now_ms)
        for meta in list(self._txns.values()):
            if meta.state.completing:
                log.info("recovery: completing %s of transactional id %r on %d partitions",
                         meta.state.value, meta.transactional_id, len(meta.partitions))
                self._complete(meta, now_ms)
        self._discard_orphaned_offsets()
        if self._txns:
            open_count = sum(m.state is TxnState.ONGOING for m in self._txns.values())
            log.info("recovered %d transactional ids (%d with an open transaction)", len(self._txns), open_count)

    def _restore_markers(self, meta: TxnMetadata, now_ms: int) -> None:
        """Write again the markers of ``meta`` a crash lost; log what is left unsynced (normally nothing).

        The record is not fsynced (one per id would slow every start): if a crash loses it, the next
        start finds the same entries settled. One can only mislead once its producer wrote a new
        transaction there, and that waited for the fsync of an AddPartitionsToTxn record after this one."""
        restored = meta.copy()
        restored.unsynced_markers = restore(meta.unsynced_markers, self._partition_log, COORDINATOR_EPOCH, now_ms,
                                            self._data_arrived)
        # meta.last_update_ms: a restart does not postpone the id's expiration
        self._log_and_install(restored, meta.last_update_ms, sync=False)

    def _discard_orphaned_offsets(self) -> None:
        live = {m.txn_producer_id for m in self._txns.values() if m.state is TxnState.ONGOING or m.state.completing}
        for group_id, producer_id in self._offsets.pending_producers():
            if producer_id not in live:
                log.warning("discarding pending offsets of group %r for producer %d: no open transaction",
                            group_id, producer_id)
                self._offsets.complete_pending(group_id, producer_id, commit=False)

    def close(self) -> None:
        """Close the transaction log."""
        self._log.close()

    async def run_periodic(self) -> None:
        """Abort timed-out transactions and forget expired ids every check interval (until cancelled)."""
        while True:
            await asyncio.sleep(self.settings.check_interval_ms / 1000)
            try:
                self.check(int(time.time() * 1000))
            except Exception:
                log.exception("transaction timeout/expiration check failed")

    def check(self, now_ms: int) -> None:
        """The periodic sweep: retry unfinished completions, abort timed-out transactions, expire idle ids.

        Transactions with two-phase commit (KIP-939) never time out. Does nothing
        once a transaction-log write has failed.
        """
        if self._log.failed:
            return
        for meta in list(self._txns.values()):
            if meta.state.completing:
                self._complete(meta, now_ms)  # a marker write failed earlier: retry
            elif (meta.state is TxnState.ONGOING and not meta.two_phase
                  and now_ms - meta.start_ms > meta.timeout_ms):
                log.warning("aborting transaction of %r (producer %d epoch %d): open for %d ms, timeout %d ms",
                            meta.transactional_id, meta.producer_id, meta.producer_epoch,
                            now_ms - meta.start_ms, meta.timeout_ms)
                aborting = meta.copy()
                aborting.bump_epoch(self._allocate)  # fences the producer, like Kafka
                self._prepare_and_complete(aborting, commit=False, now_ms=now_ms)
            elif meta.state.idle and now_ms - meta.last_update_ms > self.settings.id_expiration_ms:
                if still_unsynced(meta.unsynced_markers, self._partition_log):
                    continue  # its tombstone would forget markers a crash could still lose: next check
                log.info("transactional id %r expired (idle since %d)", meta.transactional_id, meta.last_update_ms)
                TRANSITIONS.check(meta.state, TxnState.DEAD, repr(meta.transactional_id))
                self._log.append(meta.transactional_id, None)
                del self._txns[meta.transactional_id]
                self._additions.pop(meta.transactional_id, None)
                self._disown(meta)
        self._abort_hanging_due(now_ms)

    # -- InitProducerId --------------------------------------------------------------------------

    @_unavailable_when_the_log_fails(InitResult(COORDINATOR_NOT_AVAILABLE))
    def init_producer_id(self, transactional_id: str, timeout_ms: int, *, producer_id: int = -1,
                         producer_epoch: int = -1, enable_two_phase: bool = False, keep_prepared: bool = False,
                         now_ms: int) -> InitResult:
        """InitProducerId: a producer id and the next epoch for ``transactional_id``, fencing older instances.

        An open transaction is aborted first, unless ``keep_prepared`` (KIP-939)
        keeps it for the new instance to commit or abort. A retry from the
        previous (id, epoch) whose answer was lost gets the same answer again.
        """
        if self._log.failed:
            return InitResult(COORDINATOR_NOT_AVAILABLE)  # until a restart replays what is durable
        if enable_two_phase and not self.settings.allow_two_phase:
            return InitResult(TRANSACTIONAL_ID_AUTHORIZATION_FAILED)  # what Kafka 4.1 answers
        if not enable_two_phase and not 0 < timeout_ms <= self.settings.max_timeout_ms:
            return InitResult(INVALID_TRANSACTION_TIMEOUT)
        meta = self._txns.get(transactional_id)
        requested_by = (producer_id, producer_epoch) if producer_id != -1 else None
        if meta is None:
            if requested_by:
                return InitResult(INVALID_PRODUCER_ID_MAPPING)
            meta = TxnMetadata(transactional_id, self._allocate(), 0, timeout_ms, two_phase=enable_two_phase)
            return self._granted(self._log_and_install(meta, now_ms))
        if requested_by and requested_by not in (meta.current, meta.previous):
            return InitResult(PRODUCER_FENCED)  # KIP-360: only the current instance may bump its own epoch
        if requested_by == meta.previous and (meta.state is TxnState.EMPTY or (keep_prepared and meta.taken_over)):
            # Nothing happened since the bump this instance asked for: a retry whose answer was lost.
            log.info("InitProducerId for %r retried with the previous producer %d epoch %d: answering %d epoch %d",
                     transactional_id, producer_id, producer_epoch, meta.producer_id, meta.producer_epoch)
            return self._granted(meta)
        if meta.state.completing:
            meta = self._complete(meta, now_ms)
            if meta.state.completing:
                return InitResult(CONCURRENT_TRANSACTIONS)
        if meta.state is TxnState.ONGOING and keep_prepared:
            keeping = meta.copy()
            keeping.bump_epoch(self._allocate, requested_by)
            keeping.two_phase = meta.two_phase or enable_two_phase
            return self._granted(self._log_and_install(keeping, now_ms))
        if meta.state is TxnState.ONGOING:
            log.info("InitProducerId for %r aborts its open transaction (producer %d epoch %d)",
                     transactional_id, meta.txn_producer_id, meta.txn_producer_epoch)
            # requested_by is kept through the abort: if it has to be retried (CONCURRENT_TRANSACTIONS),
            # the retry presents the same pair, now the previous one
            aborting = meta.copy()
            aborting.bump_epoch(self._allocate, requested_by)
            meta = self._prepare_and_complete(aborting, commit=False, now_ms=now_ms)
            if meta.state.completing:
                return InitResult(CONCURRENT_TRANSACTIONS)
        granted = meta.copy()
        granted.bump_epoch(self._allocate, requested_by)
        if not (keep_prepared and meta.state in (TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT)):
            # A take-over that finds the transaction already ended keeps the outcome describable: a
            # second completer of the same prepared transaction must learn it was committed, not "gone".
            granted.transition(TxnState.EMPTY)
        granted.timeout_ms = timeout_ms
        granted.two_phase = enable_two_phase
        return self._granted(self._log_and_install(granted, now_ms))

    @staticmethod
    def _granted(meta: TxnMetadata) -> InitResult:
        """The current pair, plus the kept transaction's pair after a KIP-939 take-over."""
        if meta.taken_over:
            return InitResult(NONE, meta.producer_id, meta.producer_epoch,
                              meta.txn_producer_id, meta.txn_producer_epoch)
        return InitResult(NONE, meta.producer_id, meta.producer_epoch)

    # -- adding partitions, groups and offsets ---------------------------------------------------

    def _current(self, transactional_id: str, producer_id: int, producer_epoch: int) -> tuple[int, TxnMetadata | None]:
        """The metadata if (producer id, epoch) is the current instance's, else the error."""
        if self._log.failed:
            return COORDINATOR_NOT_AVAILABLE, None
        meta = self._txns.get(transactional_id)
        if meta is None or meta.producer_id != producer_id:
            return INVALID_PRODUCER_ID_MAPPING, None
        if meta.producer_epoch != producer_epoch:
            return PRODUCER_FENCED, None
        return NONE, meta

    def _open_for_additions(self, transactional_id: str, producer_id: int, producer_epoch: int,
                            now_ms: int) -> tuple[int, TxnMetadata | None]:
        """A copy of the metadata with the transaction open (begun if none was), to add to and log."""
        error, meta = self._current(transactional_id, producer_id, producer_epoch)
        if error:
            return error, None
        if meta.state.completing:
            return CONCURRENT_TRANSACTIONS, None
        if meta.taken_over:
            return INVALID_TXN_STATE, None  # KIP-939: a kept prepared transaction only gets committed or aborted
        adding = meta.copy()
        if adding.state.idle:
            adding.begin(now_ms)
        return NONE, adding

    @_unavailable_when_the_log_fails(COORDINATOR_NOT_AVAILABLE)
    def add_partitions(self, transactional_id: str, producer_id: int, producer_epoch: int,
                       partitions: Iterable[tuple[str, int]], now_ms: int) -> int:
        """AddPartitionsToTxn: add the partitions to the open transaction (begun if none is); an error code."""
        error, adding = self._open_for_additions(transactional_id, producer_id, producer_epoch, now_ms)
        if error:
            return error
        partitions = set(partitions)
        if self._txns[transactional_id].state is TxnState.ONGOING and partitions <= adding.partitions:
            return NONE  # a retry: nothing new to log
        adding.partitions |= partitions
        if len(adding.partitions) > MAX_PARTITIONS_PER_TXN:
            log.warning("transactional id %r: refusing more than %d partitions in one transaction",
                        transactional_id, MAX_PARTITIONS_PER_TXN)
            return TRANSACTION_ABORTABLE
        # Answered before the record is fsynced (see additions_durable): the fsync, off the event loop,
        # overlaps the producer's round trip to its first Produce instead of adding to it.
        self._log_and_install(adding, now_ms, sync=False)
        self._additions[transactional_id] = self._log.log_end_offset
        return NONE

    def sync_soon(self) -> None:
        """Start an fsync of the transaction log's lazy records now, in a worker thread (from the event loop)."""
        self._group_commit.sync_soon(self._log, _nothing)

    async def additions_durable(self, transactional_id: str) -> None:
        """Return once the records of ``transactional_id``'s AddPartitionsToTxn calls are fsynced.

        Produce awaits this before it checks and appends a transactional batch: a partition takes no
        data of a transaction before the record naming it in the transaction is durable. Otherwise a
        crash of the machine could keep the data and lose the record, and recovery would find a
        transaction open on a partition its coordinator does not know of (a hanging transaction that
        only an operator may abort). A failed fsync returns too: the log has failed, and
        :meth:`check_produce` refuses the batches.
        """
        while (end := self._additions.get(transactional_id)) is not None:  # another may come meanwhile
            if self._log.high_watermark >= end:
                del self._additions[transactional_id]
                return
            try:
                await self._group_commit.durable(self._log, end, _nothing)
            except KafkaError:
                return  # the log failed (and said so): check_produce answers NOT_ENOUGH_REPLICAS

    @_unavailable_when_the_log_fails(COORDINATOR_NOT_AVAILABLE)
    def add_offsets(self, transactional_id: str, producer_id: int, producer_epoch: int, group_id: str,
                    now_ms: int) -> int:
        """AddOffsetsToTxn: add ``group_id`` to the open transaction (beginning one if none is open); an error code."""
        error, adding = self._open_for_additions(transactional_id, producer_id, producer_epoch, now_ms)
        if error:
            return error
        if group_id not in adding.groups:
            adding.groups.add(group_id)
            if len(adding.groups) > MAX_GROUPS_PER_TXN:
                log.warning("transactional id %r: refusing more than %d consumer groups in one transaction",
                            transactional_id, MAX_GROUPS_PER_TXN)
                return TRANSACTION_ABORTABLE
            self._log_and_install(adding, now_ms)
        return NONE

    def txn_offset_commit(self, transactional_id: str, producer_id: int, producer_epoch: int, group_id: str,
                          offsets: dict[tuple[str, int], tuple[int, int, str | None]], now_ms: int) -> int:
        """Stage ``offsets`` ((topic, partition) -> (offset, leader epoch, metadata)) durably as pending."""
        error, meta = self._current(transactional_id, producer_id, producer_epoch)
        if error:
            return error
        if meta.state is not TxnState.ONGOING or group_id not in meta.groups or meta.taken_over:
            return INVALID_TXN_STATE  # AddOffsetsToTxn first
        self._offsets.stage(group_id, meta.txn_producer_id, {
            key: CommittedOffset(o, e, m, now_ms) for key, (o, e, m) in offsets.items()})
        return NONE

    def check_produce(self, transactional_id: str, producer_id: int, producer_epoch: int,
                      topic: str, partition: int) -> int:
        """Whether a transactional batch may be appended: only to a partition of the open transaction."""
        if self._log.failed:
            return NOT_ENOUGH_REPLICAS  # nothing could end the transaction before a restart: take no data into it
        meta = self._txns.get(transactional_id)
        if meta is None or meta.producer_id != producer_id:
            return INVALID_PRODUCER_ID_MAPPING
        if producer_epoch != meta.producer_epoch:
            return INVALID_PRODUCER_EPOCH  # Produce has no PRODUCER_FENCED; clients treat 47 as fenced
        if meta.state is not TxnState.ONGOING or meta.taken_over or (topic, partition) not in meta.partitions:
            return INVALID_TXN_STATE
        return NONE

    def check_idempotent_produce(self, producer_id: int, producer_epoch: int) -> int:
        """Whether a non-transactional batch may carry this producer id: only an id handed out for
        idempotence, never a transactional id's.

        Producer ids are sequential, so a client can guess the next one; a batch claiming it (with a
        high epoch) would fence the transactional producer that gets it and refuse its coordinator's
        markers. Only ids the broker issued for idempotence get in. Their epoch is not checked: the
        Java producer bumps an idempotent producer's epoch itself (KIP-360), as Kafka allows, and a
        higher epoch on an idempotent id fences nobody but that id's own producer.
        """
        if not self._issued(producer_id):
            return UNKNOWN_PRODUCER_ID
        if producer_id in self._owners:
            return INVALID_PRODUCER_ID_MAPPING
        return NONE

    # -- hanging transactions (KIP-664) ----------------------------------------------------------

    def _holder(self, producer_id: int, topic: str, partition: int) -> TxnMetadata | None:
        """The metadata of the transactional id whose transaction (begun with ``producer_id``) includes
        the partition, whatever its state; None if no transactional id's does."""
        owner = self._owners.get(producer_id)
        meta = self._txns.get(owner) if owner is not None else None
        if meta is not None and meta.txn_producer_id == producer_id and (topic, partition) in meta.partitions:
            return meta
        return None

    def resolve_open_transactions(self, found: Iterable[OpenTxn], now_ms: int) -> None:
        """At start, after :meth:`recover`: end what partitions hold open that this coordinator does not.

        A transaction the log says completed whose marker is missing (a torn tail) gets the logged
        outcome's marker now: committed data stays committed. One of a producer id the coordinator
        has never heard of (its transaction log was lost) is aborted once the longest transaction
        timeout has passed, unless an operator ends it first; both are logged as WARNINGs naming
        partition, producer and offset. One of a producer id a known transactional id owns, on a
        partition its metadata does not hold, is left to the operator (an ERROR says so): its outcome
        is not recorded any more (say a COMMIT marker lost to damage, then a later transaction of the
        same producer), and aborting it could drop committed records.
        """
        for txn in found:
            owner = self._owners.get(txn.producer_id)
            meta = self._holder(txn.producer_id, txn.topic, txn.partition)
            holds = meta is not None
            if holds and (meta.state is TxnState.ONGOING or meta.state.completing):
                continue  # the coordinator ends it (a Prepare* left by recover() is retried by check())
            if holds and meta.state in (TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT):
                commit = meta.state is TxnState.COMPLETE_COMMIT
                log.warning("%s-%d: the transaction of %r (producer %d epoch %d, from offset %d) is %s in the "
                            "transaction log but its marker is missing: writing the %s marker",
                            txn.topic, txn.partition, meta.transactional_id, txn.producer_id, txn.producer_epoch,
                            txn.start_offset, meta.state.value, "COMMIT" if commit else "ABORT")
                try:
                    self._write_marker(meta, txn.topic, txn.partition, commit, now_ms)
                except (KafkaError, OSError) as exc:
                    log.error("%s-%d: writing the missing marker of producer %d failed; the partition's last "
                              "stable offset stays at %d until a restart: %s",
                              txn.topic, txn.partition, txn.producer_id, txn.start_offset, exc)
                continue
            if owner is not None:
                log.error("%s-%d: open transaction of producer %d epoch %d from offset %d belongs to transactional id "
                          "%r, whose transaction log does not record its outcome on this partition (a lost marker?): "
                          "leaving it open, as aborting could drop committed records; once sure it was not committed, an "
                          "operator can abort it (twophase txns find-hanging / abort --topic %s --partition %d "
                          "--producer-id %d --producer-epoch %d)", txn.topic, txn.partition, txn.producer_id,
                          txn.producer_epoch, txn.start_offset, owner, txn.topic, txn.partition, txn.producer_id,
                          txn.producer_epoch)
                continue
            deadline = now_ms + self.settings.max_timeout_ms
            log.warning("%s-%d: open transaction of producer %d epoch %d from offset %d is unknown to the transaction "
                        "coordinator (transaction log lost?): aborting it in %d ms unless an operator ends it first "
                        "(twophase txns find-hanging / abort --topic)", txn.topic, txn.partition, txn.producer_id,
                        txn.producer_epoch, txn.start_offset, self.settings.max_timeout_ms)
            self._hanging.add(txn, deadline)

    def _abort_hanging_due(self, now_ms: int) -> None:
        for txn in self._hanging.due(now_ms):
            try:
                entry = self._partition_log(txn.topic, txn.partition).producers.entry(txn.producer_id)
            except UnknownTopicOrPartitionError:
                continue  # deleted with its topic
            if entry is None or entry.txn_first_offset != txn.start_offset:
                continue  # ended meanwhile (an operator's abort)
            log.warning("%s-%d: aborting the hanging transaction of producer %d epoch %d from offset %d: its outcome "
                        "is unknown and the transaction timeout has passed", txn.topic, txn.partition,
                        txn.producer_id, entry.epoch, txn.start_offset)
            code = self.abort_hanging(txn.topic, txn.partition, txn.producer_id, entry.epoch, now_ms)
            if code:
                log.error("%s-%d: aborting the hanging transaction of producer %d failed (error %d); retrying in "
                          "%.0f s", txn.topic, txn.partition, txn.producer_id, code, HANGING_RETRY_MS / 1000)
                self._hanging.add(txn, now_ms + HANGING_RETRY_MS)

    def abort_hanging(self, topic: str, partition: int, producer_id: int, producer_epoch: int, now_ms: int) -> int:
        """Write an ABORT marker ending ``producer_id``'s open transaction on the partition (WriteTxnMarkers
        from an operator, KIP-664); an error code.

        Only a hanging transaction may be ended this way: INVALID_TXN_STATE if the producer has none
        open there, INVALID_PRODUCER_EPOCH unless ``producer_epoch`` is the one the partition holds,
        CONCURRENT_TRANSACTIONS if this coordinator holds it open (abort it by its transactional id:
        writing a marker behind the coordinator's back could abort what it then commits).
        """
        try:
            plog = self._partition_log(topic, partition)
        except UnknownTopicOrPartitionError:
            return UNKNOWN_TOPIC_OR_PARTITION
        start = plog.producers.open_transactions().get(producer_id)
        if start is None:
            return INVALID_TXN_STATE
        if plog.producers.entry(producer_id).epoch != producer_epoch:
            return INVALID_PRODUCER_EPOCH
        meta = self._holder(producer_id, topic, partition)
        if meta is not None and (meta.state is TxnState.ONGOING or meta.state.completing):
            return CONCURRENT_TRANSACTIONS
        try:
            offset = plog.append_marker(producer_id, producer_epoch, False, COORDINATOR_EPOCH, now_ms)
        except KafkaError as exc:
            log.error("%s-%d: the ABORT marker for producer %d failed: %s", topic, partition, producer_id, exc)
            return exc.code
        self._hanging.discard(topic, partition, producer_id)
        self._data_arrived(topic, partition)
        log.warning("%s-%d: aborted the hanging transaction of producer %d epoch %d (offsets %d-%d)",
                    topic, partition, producer_id, producer_epoch, start, offset)
        return NONE

    # -- EndTxn ----------------------------------------------------------------------------------

    @_unavailable_when_the_log_fails(COORDINATOR_NOT_AVAILABLE)
    def end_txn(self, transactional_id: str, producer_id: int, producer_epoch: int, commit: bool,
                now_ms: int) -> int:
        """EndTxn: log the decision, write the markers, complete; an error code.

        Idempotent: a retry of a completed or completing decision returns NONE
        (CONCURRENT_TRANSACTIONS while markers are still missing). NONE means the
        decision is durable; markers that failed are retried by :meth:`check`.
        """
        error, meta = self._current(transactional_id, producer_id, producer_epoch)
        if error:
            return error
        done = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        preparing = TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT
        if meta.state is done:
            return NONE  # a retry of what already happened
        if meta.state is preparing:
            return NONE if self._complete(meta, now_ms).state is done else CONCURRENT_TRANSACTIONS
        if meta.state is not TxnState.ONGOING:
            return INVALID_TXN_STATE
        self._failpoint.hit("before_prepare")
        self._prepare_and_complete(meta.copy(), commit, now_ms)
        return NONE  # the decision is durable; markers that failed are retried by check()

    def _prepare_and_complete(self, deciding: TxnMetadata, commit: bool, now_ms: int) -> TxnMetadata:
        """Log the decision on ``deciding`` (an Ongoing copy, not installed), then complete it; the
        installed metadata, still Prepare* if completion has to be retried later."""
        deciding.transition(TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT)
        meta = self._log_and_install(deciding, now_ms)
        self._failpoint.hit("after_prepare")
        return self._complete(meta, now_ms)

    def _complete(self, meta: TxnMetadata, now_ms: int) -> TxnMetadata:
        """Write markers and apply/discard group offsets for a Prepare* state, then log Complete*;
        the installed metadata (still ``meta`` if a marker failed)."""
        commit = meta.state is TxnState.PREPARE_COMMIT
        unsynced = meta.unsynced_markers
        try:
            for i, (topic, partition) in enumerate(sorted(meta.partitions)):
                if i == 1:
                    self._failpoint.hit("between_markers")
                written = self._write_marker(meta, topic, partition, commit, now_ms, flush=False)
                if written is not None:
                    unsynced = record(unsynced, written)
            if len(unsynced) > MAX_UNSYNCED:
                sync_all(unsynced, self._partition_log)  # the log records would grow without bound
            for group_id in sorted(meta.groups):
                self._offsets.complete_pending(group_id, meta.txn_producer_id, commit)
        except (KafkaError, OSError) as exc:
            self._completion_failed(meta, exc)
            return meta
        self._completion_errors.pop(meta.transactional_id, None)
        self._failpoint.hit("after_markers")
        completed = meta.copy()
        completed.transition(TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT)
        completed.unsynced_markers = unsynced
        # Not fsynced on its own: a crash that loses it leaves the Prepare*, and recovery completes that
        # again (writing a marker twice changes nothing). The next record of any id covers it, and any
        # next step of this id (a new transaction, a new epoch) logs and fsyncs one.
        return self._log_and_install(completed, now_ms, sync=False)

    def _completion_failed(self, meta: TxnMetadata, exc: BaseException) -> None:
        """Log a failed completion as an ERROR once per COMPLETION_ERROR_LOG_INTERVAL_S per id: the
        periodic check and every client retry try again, and one stuck transaction must not flood the log."""
        now = time.monotonic()
        last = self._completion_errors.get(meta.transactional_id)
        if last is None or now - last >= COMPLETION_ERROR_LOG_INTERVAL_S:
            self._completion_errors[meta.transactional_id] = now
            log.error("completing %s of %r failed, will retry (logged again in %.0f s if it still fails): %s",
                      meta.state.value, meta.transactional_id, COMPLETION_ERROR_LOG_INTERVAL_S, exc)
        else:
            log.debug("completing %s of %r failed again: %s", meta.state.value, meta.transactional_id, exc)

    def _write_marker(self, meta: TxnMetadata, topic: str, partition: int, commit: bool, now_ms: int,
                      *, flush: bool = True) -> UnsyncedMarker | None:
        """Write the marker ending ``meta``'s transaction on the partition; the marker if it is not
        fsynced yet (``flush=False`` under an fsync interval), for the log to keep until it is."""
        try:
            plog = self._partition_log(topic, partition)
        except UnknownTopicOrPartitionError:
            log.warning("no marker for %s-%d (transactional id %r): the partition is gone",
                        topic, partition, meta.transactional_id)
            return None
        offset = plog.append_marker(meta.txn_producer_id, meta.marker_epoch, commit, COORDINATOR_EPOCH, now_ms,
                                    flush=flush)
        self._data_arrived(topic, partition)
        if plog.flushed_end > offset:
            return None
        return UnsyncedMarker(topic, partition, meta.txn_producer_id, meta.marker_epoch, commit, offset)

    def _log_and_install(self, changed: TxnMetadata, now_ms: int, *, sync: bool = True) -> TxnMetadata:
        """Make ``changed`` (a copy nobody else holds) the id's state once it is durable (only written,
        if not ``sync``). A failed write raises TransactionLogFailed and leaves memory at the last
        durable state."""
        changed.last_update_ms = now_ms
        changed.unsynced_markers = still_unsynced(changed.unsynced_markers, self._partition_log)
        self._log.append(changed.transactional_id, changed.to_dict(), sync=sync)
        old = self._txns.get(changed.transactional_id)
        self._txns[changed.transactional_id] = changed
        if old is not None:
            self._disown(old)
        self._own(changed)
        return changed

    def _own(self, meta: TxnMetadata) -> None:
        for producer_id in (meta.producer_id, meta.txn_producer_id):
            if producer_id >= 0:
                self._owners[producer_id] = meta.transactional_id

    def _disown(self, meta: TxnMetadata) -> None:
        for producer_id in (meta.producer_id, meta.txn_producer_id):
            if self._owners.get(producer_id) == meta.transactional_id:
                del self._owners[producer_id]

    # -- ListTransactions / DescribeTransactions -------------------------------------------------

    def list_transactions(self, states: Iterable[str] = (), producer_ids: Iterable[int] = (),
                          min_duration_ms: int = -1, pattern: str | None = None,
                          now_ms: int = 0) -> tuple[int, list[str], list[tuple[str, int, str]]]:
        """(error, unknown state filters, [(transactional id, producer id, state)]) like Kafka's filters."""
        known = {s.value for s in TxnState} - {TxnState.DEAD.value}
        states, producer_ids = set(states), set(producer_ids)
        # RE2 (linear time, like Kafka's RE2/J) because the pattern is the client's and matching runs
        # on the event loop: a backtracking engine would let "(a+)+b" stall the whole broker.
        try:
            if pattern and len(pattern) > MAX_PATTERN_LENGTH:
                raise re2.error(f"longer than {MAX_PATTERN_LENGTH} characters")
            regex = re2.compile(pattern, _PATTERN_OPTIONS) if pattern else None
        except re2.error as exc:
            log.info("ListTransactions: invalid transactional id pattern %.100r: %s", pattern, exc)
            return INVALID_REGULAR_EXPRESSION, [], []
        found = []
        for tid, meta in sorted(self._txns.items()):
            if ((states and meta.state.value not in states)
                    or (producer_ids and not producer_ids & {meta.producer_id, meta.txn_producer_id})
                    or (min_duration_ms >= 0 and now_ms - meta.start_ms <= min_duration_ms)
                    or (regex and not regex.fullmatch(tid))):
                continue
            found.append((tid, meta.producer_id, meta.state.value))
        return NONE, sorted(states - known), found

    def describe(self, transactional_id: str) -> TxnDescription | None:
        """The transactional id's state for DescribeTransactions, or None if it is unknown."""
        meta = self._txns.get(transactional_id)
        if meta is None:
            return None
        partitions = () if meta.state.idle else tuple(sorted(meta.partitions))  # Kafka clears them on completion
        return TxnDescription(transactional_id, meta.state.value, meta.producer_id, meta.producer_epoch,
                              meta.timeout_ms, meta.start_ms, partitions)
