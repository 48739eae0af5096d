"""Replaying a FAILED epoch: Spark runs it again from its recorded offsets, and phase two starts over.

An epoch is FAILED when a pre-commit can never be committed; with the log sink on a Kafka cluster
(classic mode) that is a transaction the broker aborted because its commit came after the
transaction timeout. Nothing of it became visible, and Spark's checkpoint says the batch is done.
With a replayable source the batch can be run again, exactly once, by rewinding both sides:

1. ZooKeeper: a ``replay`` mark makes phase two of the query wait; every pre-commit of epochs >= N
   is aborted (later epochs waited behind N, so none of them is committed) and their records
   deleted, epoch N first: an abort that finds a handle of N committed ends the replay there,
   nothing rewound.
2. The Spark checkpoint: commits/K for K >= N and offsets/K for K > N are removed, and state store
   files of versions above N, so the restarted query runs batch N again with the offsets of
   offsets/N and the state it started from, then plans new batches.
3. The barrier is set back to N - 1 and the mark removed. Interrupted anywhere, a second run
   resumes from the mark.

It refuses, changing nothing, where that would not be exactly once: a run of the query is alive;
epoch N is not FAILED or an earlier epoch is not committed; part of epoch N was committed already
(its rows would be written twice); the failure is an abort found committed, or a commit whose
outcome the sink could not tell (CommitOutcomeUnknown); the checkpoint lacks
offsets/N; or a state store no longer holds the state batch N starts from (Spark keeps the last
``spark.sql.streaming.minBatchesToRetain`` versions, 100 by default).

Example::

    plan = plan_replay(read_status(client, paths, signer), query_id, epoch=7, checkpoint="/ckpt/q")
    removed, report = replay(app_coordinator, plan)     # report.ok: restart the query
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordinator.app import AppCoordinator
from coordinator.layout import QueryPaths
from coordinator.report import OperationFailed, PassReport
from coordinator.state import EpochState
from coordinator.status import AppStatus, QueryStatus
from coordinator.zk import dump
from twophase.checkpoint import local_path, missing_state, rewind


class ReplayRefused(Exception):
    """Replaying the epoch would not be exactly once (or there is nothing to replay); nothing changed."""


@dataclass(frozen=True)
class ReplayPlan:
    """What :func:`replay` does: the query, the FAILED epoch, its checkpoint, the later epochs discarded too."""

    query_id: str
    epoch: int
    checkpoint: str
    later_epochs: tuple[int, ...]


def plan_replay(status: AppStatus, query_id: str, epoch: int, checkpoint: str, replaying: int = -1) -> ReplayPlan:
    """The plan to replay ``epoch`` of ``query_id``; ReplayRefused (with the reason) where it is unsafe.
    ``replaying``: the epoch an unfinished replay marked (-1: none); that replay is resumed."""
    query = next((q for q in status.queries if q.query_id == query_id), None)
    if query is None:
        raise ReplayRefused(f"app {status.app} has no query {query_id}")
    alive = [r.run_id for r in query.runs if r.alive]
    if alive:
        raise ReplayRefused(f"run {', '.join(alive)} of the query is alive: stop the query first")
    if replaying >= 0 and replaying != epoch:
        raise ReplayRefused(f"the replay of epoch {replaying} is unfinished: run it again first")
    if replaying < 0:
        _check_failed_epoch(query, epoch)
    if not os.path.exists(os.path.join(local_path(checkpoint), "offsets", str(epoch))):
        raise ReplayRefused(f"the checkpoint {checkpoint} has no offsets/{epoch}: Spark cannot run it again")
    gone = missing_state(checkpoint, epoch)
    if gone:
        raise ReplayRefused(f"state version {epoch} is no longer in the checkpoint's state stores "
                            f"({', '.join(gone[:5])}{', ...' if len(gone) > 5 else ''}): Spark cannot rebuild "
                            f"the state batch {epoch} starts from")
    later = tuple(e.epoch for e in query.epochs if e.epoch > epoch)
    return ReplayPlan(query_id, epoch, checkpoint, later)


def _check_failed_epoch(query: QueryStatus, epoch: int) -> None:
    found = next((e for e in query.epochs if e.epoch == epoch), None)
    if found is None or found.state is not EpochState.FAILED:
        state = "has no record" if found is None else f"is {found.state.value}"
        raise ReplayRefused(f"epoch {epoch} {state}: only a FAILED epoch is replayed")
    if query.watermark != epoch - 1:
        raise ReplayRefused(f"epochs up to {query.watermark} are committed, not up to {epoch - 1}: "
                            "replay the earliest FAILED epoch")
    pending = {a.name for a in found.attempts}
    committed = sorted(set(found.winners) - pending)
    if committed:
        raise ReplayRefused(f"epoch {epoch} is partly committed ({', '.join(committed)}): running it again would "
                            "write those partitions twice")
    unknown = [f.attempt for f in found.failures if f.outcome_unknown]
    if unknown:
        raise ReplayRefused(f"epoch {epoch}: whether {', '.join(unknown)} committed cannot be told (the external "
                            "system forgot it): running it again might write those rows twice")
    aborts = [f.attempt for f in found.failures if f.permanent and f.operation != "commit"]
    if aborts:
        raise ReplayRefused(f"epoch {epoch} failed on an abort found committed ({', '.join(aborts)}): its rows are "
                            "visible already")


def replay(app: AppCoordinator, plan: ReplayPlan) -> tuple[list[str], PassReport]:
    """As the app's owner: mark the replay (phase two of the query waits while the mark stands), abort
    and delete every pre-commit of epochs >= plan.epoch, then rewind the checkpoint, set the barrier
    back and unmark. Returns the checkpoint files removed and the report of the aborts. If that report
    is not ok nothing is rewound: run it again; but an abort that found a handle committed ends the
    replay (unmarked): that epoch is partly visible and is left FAILED for the operator."""
    qp = app.paths.query(plan.query_id)
    app.acquire()
    app.client.retry(app.client.ensure_path, qp.replay)
    txn = app.fence.transaction()
    txn.set_data(qp.replay, dump({"epoch": plan.epoch}))
    app.fence.commit(txn)
    report = app.discard_epochs(plan.query_id, plan.epoch)
    if not report.ok:
        if any(isinstance(r, OperationFailed) and r.permanent for r in report.records):
            _unmark(app, qp)
        return [], report
    removed = rewind(plan.checkpoint, plan.epoch)
    txn = app.fence.transaction()
    txn.set_data(qp.barrier, dump({"epoch": plan.epoch - 1, "run": None}))
    txn.delete(qp.replay)
    app.client.retry(app.client.ensure_path, qp.barrier)
    app.fence.commit(txn)
    return removed, report


def _unmark(app: AppCoordinator, qp: QueryPaths) -> None:
    txn = app.fence.transaction()
    txn.delete(qp.replay)
    app.fence.commit(txn)
