"""One task attempt's side of the two-phase commit, free of Spark.

TwoPhaseSink (a Spark ForeachWriter) builds a :class:`TaskAttempt` in ``open`` from
Spark's TaskContext and hands it every row; tests and other integrations drive the
very same code without Spark.

Usage::

    attempt = TaskAttempt(sink, PrecommitRegistry(client, query_paths, signer), ctx)
    if attempt.open():              # False: an earlier attempt of this run won the partition
        for row in rows:
            attempt.write(row)          # or attempt.write_batch(arrow_batch), or attempt.row_writer()(row)
    attempt.close(None)             # pre-commit and register; close(error) discards instead
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from coordinator.precommits import IntentGone, IntentWatch, PrecommitRegistry
from twophase.sink import TwoPhaseCommitSink, TxnContext, release


class PhaseTwoHalted(RuntimeError):
    """The driver stopped phase two for this run (its hook failed for good); tasks refuse to write.

    Raised in ``open`` so that Spark fails the query with the driver's reason instead
    of pre-committing rows that nothing would commit.
    """


class TaskAttempt:
    """Begin, write, pre-commit and register one attempt's transaction; losers abort themselves."""

    def __init__(self, sink: TwoPhaseCommitSink, registry: PrecommitRegistry, ctx: TxnContext) -> None:
        self.sink = sink
        self.registry = registry
        self.ctx = ctx
        self._txn: Any = None
        self._intent: IntentWatch | None = None  # set with _txn
        self.won: bool | None = None  # after close(None): did this attempt's pre-commit win?

    def open(self) -> bool:
        """Begin the transaction; False if this run already has a winner for the partition."""
        # halted? winner? else the intent, with a slot if the sink names anything by one
        admission = self.registry.admit(self.ctx, slot=self.sink.uses_slots)
        if admission.halted is not None:
            raise PhaseTwoHalted(f"twophase stopped run {self.ctx.run_id} of app {self.ctx.app}: {admission.halted}")
        if admission.winner is not None:
            return False
        self.ctx, self._intent = admission.ctx, admission.intent
        self._txn = self.sink.begin_transaction(self.ctx)
        return True

    def write(self, row: Any) -> None:
        """Write one row into the transaction open() began."""
        self.sink.write(self._txn, row)

    def row_writer(self) -> Callable[[Any], None]:
        """:meth:`write` with the sink's method and the transaction bound: one call per row instead
        of three. Valid until :meth:`close`."""
        return partial(self.sink.write, self._txn)

    def write_batch(self, batch: Any) -> None:
        """Write one Arrow record batch into the transaction open() began."""
        self.sink.write_batch(self._txn, batch)

    def write_dataframe(self, df: Any) -> None:
        """Have Spark write a whole DataFrame into the transaction (a sink that ``takes_dataframe``)."""
        self.sink.write_dataframe(self._txn, df)

    def close(self, error: BaseException | None) -> None:
        """Pre-commit and register (error is None), or discard the open transaction."""
        txn, self._txn = self._txn, None
        if txn is None:
            return
        if error is not None:
            self.sink.abort_transaction(txn)
            self.registry.drop_intent(self.ctx)  # cleaned up already: nothing for abort_unregistered
            return
        try:
            holds_intent = self._intent.held()
        except BaseException:
            self.sink.abort_transaction(txn)  # ZooKeeper gone: nothing may be registered; free the producer
            raise
        if not holds_intent:
            # A zombie that outlived its epoch: it ends its own transaction with its own producer (which
            # fences nobody: refused if its id moved on) and registers nothing.
            gone = IntentGone(f"attempt {self.ctx.name} was cleaned up by the coordinator while it ran: "
                              "its epoch was settled without it; its rows are discarded")
            try:
                self.sink.abort_transaction(txn)
            except Exception as e:
                raise gone from e
            raise gone
        handle = self.sink.pre_commit(txn)
        try:
            self.won = self.registry.register(self.ctx, handle)
        except IntentGone:
            # A zombie. With slots its transactional id may be another attempt's now: hands off. Without, its
            # pre-commit is named by attempt and nobody's else; ending it here is the only way it ends.
            if not self.sink.uses_slots:
                self._abort(handle)
            raise
        except BaseException:
            self._abort(handle)
            raise
        if not self.won:
            self._abort(handle)
            self.registry.forget(self.ctx)

    def _abort(self, handle: Any) -> None:
        """Abort the attempt's own pre-commit (it lost, or cannot be registered): phase two in a task,
        whose copy of the sink then keeps nothing open (PostgresSink's idle connection)."""
        try:
            self.sink.abort(handle)
        finally:
            release(self.sink)
