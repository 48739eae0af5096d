"""Replaying a FAILED epoch: Spark runs it again from its recorded offsets, and phase two starts over.

An epoch is FAILED when a pre-commit can never be committed; with the log sink on a Kafka cluster
(classic mode) that is a transaction the broker aborted because its commit came after the
transaction timeout. Nothing of it became visible, and Spark's checkpoint says the batch is done.
With a replayable source the batch can be run again, exactly once, by rewinding both sides:

1. The Spark checkpoint: commits/K for K >= N and offsets/K for K > N are removed, so the restarted
   query runs batch N again with the offsets of offsets/N, then plans new batches.
2. ZooKeeper: every pre-commit of epochs >= N is aborted (later epochs waited behind N, so none of
   them is committed), their records deleted, and the barrier set back to N - 1.

It refuses, changing nothing, where that would not be exactly once: a run of the query is alive;
epoch N is not FAILED or an earlier epoch is not committed; part of epoch N was committed already
(its rows would be written twice); the failure is an abort found committed; the checkpoint lacks
offsets/N; or a state store no longer holds the state batch N starts from (Spark keeps the last
``spark.sql.streaming.minBatchesToRetain`` versions, 100 by default).

Example::

    plan = plan_replay(read_status(client, paths, signer), query_id, epoch=7, checkpoint="/ckpt/q")
    replay(app_coordinator, plan)          # then restart the query
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from coordinator.app import AppCoordinator
from coordinator.report import PassReport
from coordinator.state import EpochState
from coordinator.status import AppStatus
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


def plan_replay(status: AppStatus, query_id: str, epoch: int, checkpoint: str) -> ReplayPlan:
    """The plan to replay ``epoch`` of ``query_id``; ReplayRefused (with the reason) where it is unsafe."""
    query = next((q for q in status.queries if q.query_id == query_id), None)
    if query is None:
        raise ReplayRefused(f"app {status.app} has no query {query_id}")
    alive = [r.run_id for r in query.runs if r.alive]
    if alive:
        raise ReplayRefused(f"run {', '.join(alive)} of the query is alive: stop the query first")
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
    aborts = [f.attempt for f in found.failures if f.permanent and f.operation != "commit"]
    if aborts:
        raise ReplayRefused(f"epoch {epoch} failed on an abort found committed ({', '.join(aborts)}): its rows are "
                            "visible already")
    if not os.path.exists(os.path.join(local_path(checkpoint), "offsets", str(epoch))):
        raise ReplayRefused(f"the checkpoint {checkpoint} has no offsets/{epoch}: Spark cannot run it again")
    gone = missing_state(checkpoint, epoch)
    if gone:
        raise ReplayRefused(f"state version {epoch} is no longer in the checkpoint's state stores "
                            f"({', '.join(gone[:5])}{', ...' if len(gone) > 5 else ''}): Spark cannot rebuild "
                            f"the state batch {epoch} starts from")
    later = tuple(e.epoch for e in query.epochs if e.epoch > epoch)
    return ReplayPlan(query_id, epoch, checkpoint, later)


def replay(app: AppCoordinator, plan: ReplayPlan) -> tuple[list[str], PassReport]:
    """Rewind the checkpoint, then (as the app's owner) discard epochs >= plan.epoch and set the barrier
    back. Returns the checkpoint files removed and the report of the aborts; if that report is not ok,
    run it again. Checkpoint first: interrupted after it, a second run finds the same FAILED epoch."""
    removed = rewind(plan.checkpoint, plan.epoch)
    app.acquire()
    report = app.discard_epochs(plan.query_id, plan.epoch)
    if report.ok:
        qp = app.paths.query(plan.query_id)
        txn = app.fence.transaction()
        txn.set_data(qp.barrier, dump({"epoch": plan.epoch - 1, "run": None}))
        app.client.retry(app.client.ensure_path, qp.barrier)
        app.fence.commit(txn)
    return removed, report
