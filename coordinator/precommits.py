"""Pre-commit registration: the writer side of the ZooKeeper state.

Every pre-committed transaction is recorded (so nobody loses track of one), and
within a run exactly one attempt per (epoch, partition) wins: its attempt node
and the ``winners/<run>.<partition>`` node are created in one multi-op, so the
second attempt to finish finds the winner and aborts its own transaction.
Before it begins, an attempt records its intent: a task killed between
pre_commit and registration leaves an intent without an attempt, which tells the
coordinator to have the sink clean up after it (``abort_unregistered``). The intent's multi-op
also claims the attempt a slot (:mod:`coordinator.slots`), a number its sink may name resources by,
unless the sink names nothing by slot (``uses_slots`` False: the intent is then empty).

Attempt and intent nodes are named by :attr:`TxnContext.name <twophase.sink.TxnContext.name>`
(``<run>.<epoch>.<partition>.<attempt>``), the name sinks use for the attempt's own resources.

A task's ``open`` is one :meth:`PrecommitRegistry.admit`: one multi-op checks that the run is not
halted and the partition has no winner, and creates the intent (and the epoch's nodes, for the
epoch's first attempt). A sink that names resources by slot first reads the partition's held
slots, and the multi-op claims the lowest free one.

Usage (in a Spark task)::

    registry = PrecommitRegistry(client, app_paths.query(ctx.query_id), signer)
    admission = registry.admit(ctx, slot=sink.uses_slots)   # ensure_run + halted + winner + intend
    if admission.halted is not None or admission.winner is not None:
        ...                                  # refuse (halted) or skip rows (an earlier attempt won)
    ctx = admission.ctx                      # the same context, with its slot (if it asked for one)
    txn = sink.begin_transaction(ctx) ...
    won = registry.register(ctx, handle)
    if not won:
        sink.abort(handle)
        registry.forget(ctx)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError, RolledBackError, RuntimeInconsistency

from coordinator.layout import QueryPaths
from coordinator.slots import holder_data, intent_data, lowest_free, slot_of_intent
from coordinator.zk import RecordError, children, dump, parse_object, read_many
from twophase.signing import Signer
from twophase.sink import TxnContext


_known_runs: set[tuple[str, str]] = set()  # per process: Spark reuses Python workers across tasks


def _halt_reason(raw: bytes) -> str:
    return raw.decode(errors="replace") or "no reason recorded"


def winner_name(ctx: TxnContext) -> str:
    """The name of the slot one attempt per (run, epoch, partition) wins: ``<run>.<partition>``."""
    return f"{ctx.run_id}.{ctx.partition}"


def run_of_winner(name: str) -> str:
    """The run of a :func:`winner_name` (a run id may itself hold dots)."""
    return name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class Attempt:
    """A registered pre-commit, as the coordinator reads it back."""

    name: str          # TxnContext.name
    run: str
    partition: int
    attempt: int
    won: bool
    handle: Any
    registered: float  # seconds since the epoch, from the znode's ctime
    zxid: int          # creation order across the whole ensemble


# How long after its intent an attempt trusts a watch that has not fired (IntentWatch) instead of asking.
TRUSTED_FOR = 1.0


@dataclass(frozen=True)
class Admission:
    """What :meth:`PrecommitRegistry.admit` found: a halt, a winner, or the recorded intent."""

    halted: str | None = None       # why the driver stopped phase two for the run: write nothing
    winner: str | None = None       # the attempt that already won (run, epoch, partition): skip the rows
    ctx: TxnContext | None = None   # neither: the intent is recorded, and this is the context with its slot
    intent: IntentWatch | None = None  # with ctx: whether the attempt still holds that intent


class IntentWatch:
    """Whether an attempt still holds its intent, told without a round trip for a young attempt.

    :meth:`PrecommitRegistry.admit` makes it right after the intent's multi-op: an exists request with a
    watch, sent without waiting for its answer (the task writes meanwhile). ZooKeeper fires the watch when
    the coordinator deletes the intent (it settled the epoch without the attempt), kazoo when it notices
    the connection dropped. A watch that has not fired is trusted for :data:`TRUSTED_FOR` seconds only: a
    connection that died silently fires nothing until kazoo's read timeout, and a zombie (an attempt that
    outlived its epoch) is old by nature, since Spark must give up on it and another attempt complete the
    epoch first. Otherwise :meth:`held` asks ZooKeeper, as :meth:`PrecommitRegistry.holds_intent` does::

        admission = registry.admit(ctx)
        ...                                  # write the attempt's rows
        if admission.intent.held():          # else a zombie: its epoch was settled without it
            handle = sink.pre_commit(txn)
    """

    def __init__(self, registry: PrecommitRegistry, ctx: TxnContext) -> None:
        self._registry = registry
        self._ctx = ctx
        self._fired = threading.Event()
        self._since = time.monotonic()
        self._watching = registry._client.exists_async(registry.intent_path(ctx), watch=lambda _: self._fired.set())

    def held(self) -> bool:
        """False once the coordinator cleaned this attempt up."""
        try:
            watching = self._watching.get() is not None  # answered long since: the task wrote in between
        except Exception:  # noqa: BLE001 - the watch is an optimisation: ask ZooKeeper instead
            watching = False
        if watching and not self._fired.is_set() and time.monotonic() - self._since < TRUSTED_FOR:
            return True
        return self._registry.holds_intent(self._ctx)


class IntentGone(RuntimeError):
    """An attempt's intent was cleaned up by the coordinator before it registered (a zombie that outlived
    its epoch): it must neither register nor abort its handle, whose transactional id (named by its
    slot) may be another attempt's by now."""


class PrecommitRegistry:
    """The pre-commits of one query in ZooKeeper: writers record them, the coordinator reads them.

    Writers (Spark tasks) call :meth:`admit` (or its parts :meth:`ensure_run`, :meth:`halted`,
    :meth:`winner`, :meth:`intend`), :meth:`holds_intent` (or the admission's :class:`IntentWatch`),
    :meth:`register` and :meth:`forget` or
    :meth:`drop_intent`; the coordinator calls
    :meth:`load`, :meth:`latest_run` and :meth:`unregistered`. See the module docstring for
    a task's sequence.

    ::

        registry = PrecommitRegistry(client, AppPaths("/twophase", "orders").query(query_id), signer)
        attempts = registry.load(epoch)            # what the coordinator commits or aborts
    """

    def __init__(self, client: KazooClient, paths: QueryPaths, signer: Signer) -> None:
        self._client = client
        self._paths = paths
        self._signer = signer

    def ensure_run(self, run_id: str) -> None:
        """Record the run before its first pre-commit: run nodes' creation order is run start order."""
        if (self._paths.base, run_id) not in _known_runs:
            self._client.retry(self._client.ensure_path, self._paths.run(run_id))
            _known_runs.add((self._paths.base, run_id))

    def halted(self, run_id: str) -> str | None:
        """Why the driver stopped phase two for this run, or None (the run may write)."""
        try:
            raw, _ = self._client.retry(self._client.get, self._paths.halted(run_id))
        except NoNodeError:
            return None
        return _halt_reason(raw)

    def admit(self, ctx: TxnContext, slot: bool = True) -> Admission:
        """Everything a task's ``open`` asks of ZooKeeper: :meth:`ensure_run` (once per process), then one
        multi-op that checks the run is not halted and the partition has no winner, and records the intent
        (:meth:`intend`'s), creating the epoch's nodes with it if they are missing. ``slot`` True (a sink
        that names resources by slot): the partition's held slots and the epoch's node are read first, in
        one pipelined round trip, to pick the slot. A halt is reported before a winner, as separate calls
        (:meth:`halted`, :meth:`winner`) would; either costs one more read, of its reason or name."""
        self.ensure_run(ctx.run_id)
        admission = self._client.retry(self._admit, ctx, slot)
        if admission.ctx is None:
            return admission
        return replace(admission, intent=IntentWatch(self, admission.ctx))

    def _admit(self, ctx: TxnContext, slot: bool) -> Admission:
        if not slot:
            # Nothing to read. Spark launches an epoch's tasks in partition order, so partition 0's first attempt
            # makes the epoch's nodes and the others take them as made; a wrong guess costs one more try.
            first = ctx.partition == 0 and ctx.attempt == 0
            return self._intend(ctx, None, epoch_made=False if first else None, pool_made=True, admitting=True)
        held = self._client.get_children_async(self._paths.partition_slots(ctx.partition))
        epoch_made = self._client.exists_async(self._paths.winners(ctx.epoch))
        try:
            slots, pool_made = {int(n) for n in held.get() if n.isdigit()}, True
        except NoNodeError:
            slots, pool_made = set(), False
        return self._intend(ctx, slots, epoch_made=epoch_made.get() is not None, pool_made=pool_made, admitting=True)

    def latest_run(self, attempts: Sequence[Attempt], others: Iterable[str] = ()) -> str | None:
        """The most recently started run among those with attempts and ``others`` (runs without any, such
        as those whose write of the epoch failed).

        By run start order, not by registration order: a zombie writer of a dead
        run that registers late must not pass for the run that completed the epoch.
        Runs without a run node (none in practice) rank by their first registration.
        """
        runs = dict.fromkeys(others, 0) | {a.run: a.zxid for a in reversed(attempts)}  # reversed: the first zxid wins
        if len(runs) == 1:
            return next(iter(runs))  # nothing to rank it against
        pending = {run: self._client.exists_async(self._paths.run(run)) for run in runs}
        rank = {}
        for run, result in pending.items():
            stat = result.get()
            rank[run] = stat.czxid if stat else runs[run]
        return max(rank, key=rank.get) if rank else None

    def winner(self, ctx: TxnContext) -> str | None:
        """The attempt that already won this (run, epoch, partition), if any."""
        try:
            raw, _ = self._client.retry(self._client.get, f"{self._paths.winners(ctx.epoch)}/{winner_name(ctx)}")
        except NoNodeError:
            return None
        return raw.decode()

    def intend(self, ctx: TxnContext) -> TxnContext:
        """Record that this attempt is about to begin a transaction; return ``ctx`` with its slot.

        The intent and the lowest free slot of the partition are created in one multi-op; a slot
        taken meanwhile by another attempt is skipped for the next number. A retried call (a
        connection loss hid whether the multi-op went through) finds its own intent and slot.
        """
        return self._client.retry(self._read_and_intend, ctx)

    def _read_and_intend(self, ctx: TxnContext) -> TxnContext:
        pool = self._paths.partition_slots(ctx.partition)
        held = {int(n) for n in children(self._client, pool) if n.isdigit()}
        epoch_made = self._client.exists(self._paths.winners(ctx.epoch)) is not None
        return self._intend(ctx, held, epoch_made=epoch_made, pool_made=True, admitting=False).ctx

    def _intend(self, ctx: TxnContext, held: set[int] | None, epoch_made: bool | None, pool_made: bool,
                admitting: bool) -> Admission:
        """The intent multi-op. The first attempt of an epoch creates the epoch's node and its
        ``intents``, ``attempts`` and ``winners`` children in the same multi-op (one write where
        ensure_path took a dozen round trips), so registration never finds them missing. ``epoch_made``
        False: create them (a multi-op finding them made tries again without); None: take them as made
        (one finding them missing tries again with). ``held`` None: no slot is claimed (the intent is
        empty, as :func:`~coordinator.slots.slot_of_intent` reads).

        ``admitting``: the multi-op also checks that the run's ``halted`` node and the partition's winner
        are absent, by creating and deleting each (ZooKeeper has no "check absent"; a multi-op is atomic,
        so no reader sees them, but a watch on either node, or on the children of ``runs/<run>`` or
        ``winners``, would fire at every ``open``: nothing sets one); finding either, it reads it and
        returns the halt or the winner."""
        epoch = self._paths.epoch(ctx.epoch)
        intent = self.intent_path(ctx)
        pool = self._paths.partition_slots(ctx.partition)
        absent = {"halted": self._paths.halted(ctx.run_id),
                  "winner": f"{self._paths.winners(ctx.epoch)}/{winner_name(ctx)}"} if admitting else {}
        while True:
            slot = None if held is None else lowest_free(held)
            txn = self._client.transaction()
            ops = []
            if epoch_made is False:  # created empty: an OPEN epoch (coordinator/state.py)
                for path in (epoch, self._paths.intents(ctx.epoch), self._paths.attempts(ctx.epoch),
                             self._paths.winners(ctx.epoch)):
                    txn.create(path)
                    ops.append(("epoch", path))
            if not pool_made:
                txn.create(pool)
                ops.append(("pool", pool))
            for op, path in absent.items():  # the halt before the winner: the order a failed multi-op reports
                txn.create(path)
                txn.delete(path)
                ops += [(op, path), (op, path)]
            txn.create(intent, intent_data(slot))
            ops.append(("intent", intent))
            if slot is not None:
                txn.create(f"{pool}/{slot}", holder_data(ctx))
                ops.append(("slot", f"{pool}/{slot}"))
            results = txn.commit()
            failed = [(op, path, r) for (op, path), r in zip(ops, results, strict=True)
                      if isinstance(r, Exception) and not isinstance(r, (RolledBackError, RuntimeInconsistency))]
            if not failed:
                return Admission(ctx=replace(ctx, slot=slot))
            op, path, error = failed[0]
            if isinstance(error, NodeExistsError) and op in absent:
                try:
                    raw, _ = self._client.get(path)
                except NoNodeError:
                    continue  # gone meanwhile (its run or epoch was cleaned up): ask again
                return Admission(halted=_halt_reason(raw)) if op == "halted" else Admission(winner=raw.decode())
            if isinstance(error, NodeExistsError) and op == "intent":  # our own earlier try went through
                raw, _ = self._client.get(intent)
                return Admission(ctx=replace(ctx, slot=slot_of_intent(raw, intent)))
            if isinstance(error, NodeExistsError) and op == "epoch":
                epoch_made = True  # another attempt of the epoch created it meanwhile (or our earlier try did)
            elif isinstance(error, NodeExistsError) and op == "pool":
                pool_made = True
            elif isinstance(error, NodeExistsError) and op == "slot":
                held.add(slot)  # another attempt claimed it first
            elif isinstance(error, NoNodeError) and epoch_made is None and op in ("winner", "intent"):
                epoch_made = False  # the epoch's first attempt: make its nodes in the multi-op
            elif isinstance(error, NoNodeError):
                # A parent is missing: the query's first epoch (no epochs/, slots/), the run's node (a process
                # that recorded it before it was cleaned up), or an epoch node made without its children by an
                # earlier version. Made the slow way, then tried again.
                self._client.ensure_path(path.rsplit("/", 1)[0])
            else:
                raise RuntimeError(f"recording the intent {ctx.name} failed unexpectedly at {path}: {error!r}")

    def intent_path(self, ctx: TxnContext) -> str:
        """The znode of an attempt's intent."""
        return f"{self._paths.intents(ctx.epoch)}/{ctx.name}"

    def holds_intent(self, ctx: TxnContext) -> bool:
        """False once the coordinator cleaned this attempt up (it settled the epoch without it)."""
        return self._client.retry(self._client.exists, self.intent_path(ctx)) is not None

    def unregistered(self, epoch: int, attempts: Sequence[Attempt]) -> list[TxnContext]:
        """Attempts that began a transaction but hold no registered pre-commit, each in its slot."""
        registered = {a.name for a in attempts}
        base = self._paths.intents(epoch)
        intents = {name: f"{base}/{name}" for name in children(self._client, base) if name not in registered}
        return [self._context(name, slot_of_intent(raw, intents[name]))
                for name, raw, _ in read_many(self._client, intents)]  # an intent dropped meanwhile is cleaned up

    def runs_begun(self, epoch: int) -> set[str]:
        """The runs that began ``epoch``: with an intent, a winner or a failed write of it there."""
        listings = [(self._client.get_children_async(path), run_of) for path, run_of in (
            (self._paths.intents(epoch), lambda name: self._context(name).run_id),
            (self._paths.winners(epoch), run_of_winner),
            (self._paths.failed_writes(epoch), str))]  # one round trip; named by run
        runs = set()
        for listing, run_of in listings:
            try:
                runs.update(run_of(name) for name in listing.get())
            except NoNodeError:
                pass
        return runs

    def drop_intent(self, ctx: TxnContext) -> None:
        """Drop an attempt's intent: it cleaned up its transaction itself, or the coordinator did."""
        try:
            self._client.retry(self._client.delete, self.intent_path(ctx))
        except NoNodeError:
            pass

    def drop_unregistered_intent(self, ctx: TxnContext) -> bool:
        """Drop the intent of an attempt the coordinator cleaned up, unless it registered meanwhile (its
        registration checked the intent): then the intent stays, and so its slot, until its registered
        handle is committed or aborted. False in that case."""
        return self._client.retry(self._drop_unregistered_intent, ctx)

    def _drop_unregistered_intent(self, ctx: TxnContext) -> bool:
        attempt = f"{self._paths.attempts(ctx.epoch)}/{ctx.name}"
        txn = self._client.transaction()
        txn.create(attempt)    # fails if it registered: ZooKeeper has no "check absent"
        txn.delete(attempt)
        txn.delete(self.intent_path(ctx))
        created, _, deleted = txn.commit()
        if isinstance(created, NodeExistsError):
            return False
        if isinstance(created, NoNodeError):   # no attempt registered yet in this epoch
            self._client.ensure_path(self._paths.attempts(ctx.epoch))
            return self._drop_unregistered_intent(ctx)
        if isinstance(deleted, NoNodeError) or not isinstance(created, Exception):
            return True   # dropped now, or by an earlier try whose answer was lost
        raise RuntimeError(f"dropping the intent of {ctx.name} failed unexpectedly: {created!r}, {deleted!r}")

    def register(self, ctx: TxnContext, handle: Any) -> bool:
        """Record a pre-committed handle; True if this attempt won its partition."""
        return self._client.retry(self._register, ctx, handle)

    def _register(self, ctx: TxnContext, handle: Any) -> bool:
        # Idempotent, so that client.retry can repeat it after a connection loss
        # that hid whether the multi-op went through.
        name = ctx.name
        attempt_path = f"{self._paths.attempts(ctx.epoch)}/{name}"
        txn = self._client.transaction()
        txn.check(self.intent_path(ctx), -1)  # exists: the attempt still holds its slot
        txn.create(attempt_path, self._signer.dumps({"handle": handle, "won": True}, attempt_path))
        txn.create(f"{self._paths.winners(ctx.epoch)}/{winner_name(ctx)}", name.encode())
        intent, *created = txn.commit()
        if isinstance(intent, NoNodeError):
            if self.winner(ctx) == name:
                return True  # our own earlier try went through, and the coordinator finished it since
            raise IntentGone(f"attempt {name} was cleaned up by the coordinator while it ran (its epoch was "
                             "settled without it): it registers nothing and leaves its transaction alone, "
                             "whose transactional id may belong to another attempt now")
        errors = [r for r in created if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if not errors:
            return True
        if any(isinstance(e, NoNodeError) for e in errors):  # first registration of this epoch
            self._client.ensure_path(self._paths.attempts(ctx.epoch))
            self._client.ensure_path(self._paths.winners(ctx.epoch))
            return self._register(ctx, handle)
        winner = self.winner(ctx)
        if winner == name:
            return True  # our own earlier try went through before the connection dropped
        if winner is None:
            raise RuntimeError(f"registering {name} failed unexpectedly: {errors!r}")
        try:
            self._client.create(attempt_path, self._signer.dumps({"handle": handle, "won": False}, attempt_path))
        except NodeExistsError:
            pass
        return False

    def forget(self, ctx: TxnContext) -> None:
        """Drop a loser's records once it aborted its own transaction.

        The attempt first: while the intent lives the slot is held, so no other attempt's
        transaction can be touched by a commit or abort of this handle.
        """
        try:
            self._client.retry(self._client.delete, f"{self._paths.attempts(ctx.epoch)}/{ctx.name}")
        except NoNodeError:
            pass
        self.drop_intent(ctx)

    def record_failed_write(self, run_id: str, epoch: int, error: str) -> None:
        """Record that run ``run_id``'s write of ``epoch`` failed (the driver, before the write raises): the
        coordinator will mark the epoch FAILED rather than commit it for that run. Makes the epoch's nodes if
        no task did (the job failed before any began); idempotent."""
        self.ensure_run(run_id)  # ranks the run among the epoch's runs, as a registration of its would
        for folder in (self._paths.intents(epoch), self._paths.attempts(epoch), self._paths.winners(epoch),
                       self._paths.failed_writes(epoch)):
            self._client.retry(self._client.ensure_path, folder)
        try:
            self._client.retry(self._client.create, f"{self._paths.failed_writes(epoch)}/{run_id}",
                               dump({"error": error}))
        except NodeExistsError:
            pass

    def failed_writes(self, epoch: int) -> dict[str, str]:
        """The runs whose write of ``epoch`` failed, each with the error it recorded. RecordError, naming
        the znode, on one twophase did not write."""
        base = self._paths.failed_writes(epoch)
        found = {}
        for run, raw, _ in read_many(self._client, {n: f"{base}/{n}" for n in children(self._client, base)}):
            error = parse_object(raw, f"{base}/{run}", {}).get("error")
            if not isinstance(error, str):
                raise RecordError(f"znode {base}/{run}: \"error\" {error!r:.40} is not a string")
            found[run] = error
        return found

    def load(self, epoch: int) -> list[Attempt]:
        """Every registered attempt of an epoch, oldest first. Raises SignatureError on tampering."""
        base = self._paths.attempts(epoch)
        attempts = []
        # One round trip for the whole epoch; an attempt deleted meanwhile is already handled.
        for name, raw, stat in read_many(self._client, {n: f"{base}/{n}" for n in children(self._client, base)}):
            record = self._signer.loads(raw, f"{base}/{name}", what=f"pre-commit {name}")
            ctx = self._context(name)
            attempts.append(Attempt(name, ctx.run_id, ctx.partition, ctx.attempt, record["won"],
                                    record["handle"], stat.ctime / 1000.0, stat.czxid))
        return sorted(attempts, key=lambda a: a.zxid)

    def _context(self, name: str, slot: int | None = None) -> TxnContext:
        return TxnContext.from_name(self._paths.app, self._paths.query_id, name, slot)

