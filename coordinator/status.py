"""What an app's 2PC state looks like right now, read from ZooKeeper for ``twophase status``.

Read-only and lock-free: it may run beside a live coordinator, so what it shows can be a
moment old. The CLI words an :class:`AppStatus` for people, or prints :func:`as_json` of it.

Usage::

    status = read_status(client, AppPaths("/twophase", "orders"), signer)
    for query in status.queries:
        print(query.query_id, query.watermark, [e.state for e in query.epochs])
    status.failed_epochs          # [(query id, epoch), ...] of FAILED epochs
    status.sink_error             # why the stored sink does not verify, or None

A znode holding data twophase did not write raises RecordError (naming it); nothing is unpickled
that does not verify.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from coordinator.app import verify_stored_sink
from coordinator.layout import AppPaths, QueryPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.runs import RunRecord
from coordinator.slots import read_slots
from coordinator.state import EpochRecord, EpochState
from coordinator.zk import RecordError, children, epoch_numbers, read_epoch, read_object
from twophase.signing import SignatureError, Signer
from twophase.sink import PreparedTransaction


@dataclass(frozen=True)
class RunStatus:
    """One run (start) of a query: ``alive`` while its driver holds its ephemeral node."""

    run_id: str
    alive: bool
    started: float | None          # seconds since the epoch
    halted: str | None = None      # why the driver stopped phase two for the run, if it did


@dataclass(frozen=True)
class AttemptStatus:
    """A registered pre-commit: pending while its epoch is OPEN, in doubt once decided."""

    name: str                      # TxnContext.name
    run_id: str
    partition: int
    attempt: int
    won: bool
    in_doubt: bool
    registered: float              # seconds since the epoch


@dataclass(frozen=True)
class FailureStatus:
    """The last failure of phase two on one attempt, and how many tries failed in all."""

    attempt: str
    operation: str | None
    error: str | None
    count: int
    at: float | None
    permanent: bool
    outcome_unknown: bool = False  # the sink could not tell whether an earlier try committed it


@dataclass(frozen=True)
class EpochStatus:
    """One retained epoch: its record, its attempts not yet finished, and their failures."""

    epoch: int
    state: EpochState
    run: str | None
    winners: tuple[str, ...]
    error: str | None
    updated: float
    committed: bool                # at or below the watermark
    attempts: tuple[AttemptStatus, ...]
    failures: tuple[FailureStatus, ...]


@dataclass(frozen=True)
class QueryStatus:
    """One streaming query of the app."""

    query_id: str
    checkpoint: str | None
    watermark: int                 # every epoch at or below it is committed; -1: none yet
    barrier: int                   # the last epoch Spark reported complete; -1: none yet
    runs: tuple[RunStatus, ...]
    epochs: tuple[EpochStatus, ...]
    slots: tuple[tuple[int, int], ...] = ()  # (partition, slots held), partitions holding any


@dataclass(frozen=True)
class AppStatus:
    """One app: its coordinator mode, the current owner of its phase two, its queries."""

    app: str
    root: str
    coordinator: str | None        # "embedded" or "daemon"
    owner: str | None              # who holds the fence
    queries: tuple[QueryStatus, ...]
    sink_error: str | None = None  # the stored sink's signature does not verify: why (no coordinator loads it)
    # The sink target's prepared transactions older than the threshold asked for (they hold locks), or
    # why they could not be listed; both empty when not asked.
    prepared: tuple[PreparedTransaction, ...] = ()
    prepared_error: str | None = None

    @property
    def failed_epochs(self) -> list[tuple[str, int]]:
        """(query id, epoch) of every FAILED epoch: each blocks its query's later epochs."""
        return [(q.query_id, e.epoch) for q in self.queries for e in q.epochs if e.state is EpochState.FAILED]


def read_status(client: KazooClient, paths: AppPaths, signer: Signer,
                prepared_older_than: float | None = None) -> AppStatus:
    """The state of an existing app. SignatureError if a stored handle does not verify, RecordError if a
    znode holds data twophase did not write; a sink that does not verify is reported in ``sink_error``.

    With ``prepared_older_than`` (seconds) it also loads the stored sink (once its signature verifies)
    and asks it for its target's prepared transactions older than that; a target that cannot be asked
    is reported in ``prepared_error``."""
    config = read_object(client, paths.base, {})
    try:
        owner = client.retry(client.get, paths.fence)[0].decode(errors="replace") or None
    except NoNodeError:
        owner = None
    queries = tuple(_query_status(client, paths.query(qid), signer) for qid in children(client, paths.queries))
    sink_error = _sink_error(client, paths, signer)
    prepared: tuple[PreparedTransaction, ...] = ()
    prepared_error = None
    if prepared_older_than is not None and sink_error is None:
        try:
            prepared = tuple(_prepared(client, paths, signer, prepared_older_than))
        except Exception as e:  # noqa: BLE001 - the target being down is worth a line, not a crash
            prepared_error = f"cannot list the sink's prepared transactions: {e!r}"
    return AppStatus(paths.app, paths.root, config.get("coordinator"), owner, queries, sink_error,
                     prepared, prepared_error)


def _prepared(client: KazooClient, paths: AppPaths, signer: Signer, older_than: float) -> list[PreparedTransaction]:
    try:
        raw, _ = client.retry(client.get, paths.sink)
    except NoNodeError:
        return []
    sink = signer.loads(raw, paths.sink, what=f"sink of app {paths.app!r}")
    return sorted(sink.prepared_transactions(older_than), key=lambda t: -t.age)


def _sink_error(client: KazooClient, paths: AppPaths, signer: Signer) -> str | None:
    try:
        verify_stored_sink(client, paths, signer)  # unpickles nothing
    except SignatureError as e:
        return str(e)
    return None


def _query_status(client: KazooClient, qp: QueryPaths, signer: Signer) -> QueryStatus:
    watermark = read_epoch(client, qp.watermark)
    registry = PrecommitRegistry(client, qp, signer)
    runs = tuple(RunStatus(run, client.retry(client.exists, f"{qp.run(run)}/alive") is not None,
                           _started(client, qp.run(run)), registry.halted(run))
                 for run in children(client, qp.runs))
    epochs = []
    for epoch in epoch_numbers(client, qp.epochs):
        try:
            record = EpochRecord.decode(client.retry(client.get, qp.epoch(epoch))[0], qp.epoch(epoch))
        except NoNodeError:
            continue  # collected meanwhile
        in_doubt = record.state is not EpochState.OPEN
        attempts = tuple(AttemptStatus(a.name, a.run, a.partition, a.attempt, a.won, in_doubt, a.registered)
                         for a in registry.load(epoch))
        failures = tuple(_failure(client, qp, epoch, attempt) for attempt in children(client, qp.failures(epoch)))
        epochs.append(EpochStatus(epoch, record.state, record.run, record.winners, record.error, record.updated,
                                  epoch <= watermark, attempts, failures))
    held = Counter(slot.partition for slot in read_slots(client, qp))
    return QueryStatus(qp.query_id, read_object(client, qp.base, {}).get("checkpoint"), watermark,
                       read_epoch(client, qp.barrier), runs, tuple(epochs), tuple(sorted(held.items())))


def _started(client: KazooClient, path: str) -> float | None:
    record = RunRecord.read(client, path)
    return None if record is None else record.started


def _failure(client: KazooClient, qp: QueryPaths, epoch: int, attempt: str) -> FailureStatus:
    path = f"{qp.failures(epoch)}/{attempt}"
    data = read_object(client, path, {})
    count = data.get("count", 0)
    if isinstance(count, bool) or not isinstance(count, int):
        raise RecordError(f"znode {path}: \"count\" {count!r:.40} is not an integer")
    return FailureStatus(attempt, data.get("operation"), data.get("error"), count, data.get("at"),
                         data.get("permanent", False), data.get("outcome_unknown", False) is True)

