"""What one reconcile pass did (or, in a dry run, would do): typed records, no sentences.

:meth:`AppCoordinator.reconcile <coordinator.app.AppCoordinator.reconcile>` returns a
:class:`PassReport`; the CLI words it for people and serialises it for ``--json``. Each record
is a frozen dataclass naming the query, the epoch and, where there is one, the attempt (its
:attr:`TxnContext.name <twophase.sink.TxnContext.name>`), with the reason as an enum.

Usage::

    report = app.reconcile(PassOptions(dry_run=True))
    for record in report.records:
        if isinstance(record, EpochCommitted):
            print(record.query_id, record.epoch, len(record.attempts))
    if not report.ok:
        ...                              # an epoch is FAILED or blocked, or a cleanup failed
    json.dumps(report.to_json())         # {"app": ..., "dry_run": ..., "ok": ..., "records": [...]}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, ClassVar


class AbortReason(str, Enum):
    """Why a registered pre-commit was aborted."""

    LOST = "lost"                  # another attempt of its run won its partition
    SUPERSEDED = "superseded"      # its run did not complete the epoch: a later run re-ran it
    INCOMPLETE = "incomplete"      # recovery: Spark never completed the epoch and will re-run it
    UNPROVEN = "unproven"          # recovery: nothing proved the epoch complete; the operator vouched (--abort-unproven)
    LATE = "late"                  # registered after its epoch was committed (a zombie task)
    REPLAYED = "replayed"          # `twophase replay`: Spark re-runs the epoch from its recorded offsets
    WRITE_FAILED = "write_failed"  # the write of the run that completed the epoch failed: the epoch is FAILED


class SkipReason(str, Enum):
    """Why a pass left an epoch (and, but in recovery, every later epoch of its query) for later."""

    INCOMPLETE = "incomplete"      # Spark has not completed the epoch yet
    UNPROVEN = "unproven"          # recovery: nothing proves it complete or not; aborted on the operator's word
    CHANGED = "changed"            # its record changed during the pass; the next pass re-reads it


class Operation(str, Enum):
    """A sink call phase two makes."""

    COMMIT = "commit"
    ABORT = "abort"
    CLEANUP = "cleanup"            # abort_unregistered, for an attempt that never registered
    RETIRE = "retire"              # retire_epoch, when a committed epoch's record is dropped


def as_json(report: Any) -> dict[str, Any]:
    """A report dataclass (here or in :mod:`coordinator.status`) as JSON-ready data.

    Nested dataclasses become dicts, tuples lists, enums their values, so ``json.dumps`` keeps
    the field names as stable keys.
    """
    return asdict(report, dict_factory=lambda items: {key: _plain(value) for key, value in items})


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class _Record:
    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready data: ``kind`` plus every field."""
        return {"kind": self.kind, **as_json(self)}


@dataclass(frozen=True)
class EpochCommitted(_Record):
    """Every winner of ``run`` in the epoch is committed and the watermark moved to it.

    ::

        EpochCommitted("q-1", 7, "r2", ("r2.7.0.0", "r2.7.1.0"))
    """

    kind: ClassVar[str] = "epoch_committed"
    query_id: str
    epoch: int
    run: str | None                # None: no pre-commit registered for the epoch (no rows)
    attempts: tuple[str, ...]      # the committed attempts' names
    dry_run: bool = False


@dataclass(frozen=True)
class AttemptAborted(_Record):
    """A registered pre-commit was aborted, for ``reason``.

    ::

        AttemptAborted("q-1", 7, "r1.7.0.0", AbortReason.SUPERSEDED)
    """

    kind: ClassVar[str] = "attempt_aborted"
    query_id: str
    epoch: int
    attempt: str
    reason: AbortReason
    dry_run: bool = False


@dataclass(frozen=True)
class AttemptCleanedUp(_Record):
    """The sink cleaned up after an attempt that began a transaction and never registered it.

    ::

        AttemptCleanedUp("q-1", 7, "r1.7.3.0")
    """

    kind: ClassVar[str] = "attempt_cleaned_up"
    query_id: str
    epoch: int
    attempt: str
    dry_run: bool = False


@dataclass(frozen=True)
class OperationFailed(_Record):
    """A sink call failed ``tries`` times in this pass (``twophase status`` shows the count over all passes).

    A failed commit or abort holds back its epoch; a ``permanent`` one (CommitFailed, AbortFailed) also
    marked the epoch FAILED. A failed cleanup does not hold back the epoch and is retried.

    ::

        OperationFailed("q-1", 7, "r2.7.0.0", Operation.COMMIT, "ConnectionError('down')", 3, False)
    """

    kind: ClassVar[str] = "operation_failed"
    query_id: str
    epoch: int
    attempt: str
    operation: Operation
    error: str
    tries: int
    permanent: bool


@dataclass(frozen=True)
class EpochBlocked(_Record):
    """The epoch waits for an operator, and every later epoch of the query with it. ``failed``: it is FAILED
    (else undecided: an unfinished replay, a checkpoint to read; ``error`` says what to run). ``replay``:
    the epoch's write failed, so only ``twophase replay`` (not a retry) can bring its rows.

    ::

        EpochBlocked("q-1", 7, "r2.7.0.0: pre-committed rows are lost")
    """

    kind: ClassVar[str] = "epoch_blocked"
    query_id: str
    epoch: int
    error: str | None
    replay: bool = False
    failed: bool = True


@dataclass(frozen=True)
class EpochSkipped(_Record):
    """The pass left the epoch, and the later ones of its query, for ``reason``; not an error.

    ::

        EpochSkipped("q-1", 8, SkipReason.INCOMPLETE)
    """

    kind: ClassVar[str] = "epoch_skipped"
    query_id: str
    epoch: int
    reason: SkipReason


Record = EpochCommitted | AttemptAborted | AttemptCleanedUp | OperationFailed | EpochBlocked | EpochSkipped


@dataclass(frozen=True)
class PassReport:
    """Everything one reconcile pass of one app did, in the order it happened.

    ::

        report = app.reconcile()
        report.ok                 # False if an epoch is FAILED or blocked, or a sink call failed
        report.records            # (EpochCommitted(...), AttemptAborted(...), ...)
    """

    app: str
    dry_run: bool
    records: tuple[Record, ...]

    @property
    def ok(self) -> bool:
        """True unless an epoch is blocked or a sink call failed (the CLI then exits non-zero)."""
        return not any(isinstance(r, (OperationFailed, EpochBlocked)) for r in self.records)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data with stable keys."""
        return {"app": self.app, "dry_run": self.dry_run, "ok": self.ok,
                "records": [r.to_json() for r in self.records]}
