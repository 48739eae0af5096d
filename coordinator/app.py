"""Phase two for one app: commit completed epochs exactly once, abort the rest.

An epoch N is complete once Spark has durably finished micro-batch N. Any one
of these proves it, and each alone can be lost, so all are consulted:

- the barrier the driver's listener publishes (onQueryProgress, fast);
- a registration for a later epoch (batch N+1 starts only after commits/N);
- ``commits/N`` in the query's checkpoint directory.

The run that completed N is the most recently started run that registered for
N: once commits/N exists no later run re-runs N. Its winners are committed; every other
pre-commit of N (losers, earlier runs) is aborted. The decision is written to
ZooKeeper before any commit, so a successor resumes it rather than re-deciding.

Usage::

    app = AppCoordinator(client, "/twophase", "orders", signer, owner="driver")
    app.acquire()          # fences any previous owner
    app.run(stop_event)    # or app.reconcile() once, as the recovery CLI does
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NoNodeError, NodeExistsError
from kazoo.recipe.watchers import ChildrenWatch, DataWatch
from tenacity import Retrying, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from coordinator.fence import Fence, Fenced
from coordinator.layout import AppPaths, QueryPaths
from coordinator.precommits import Attempt, PrecommitRegistry
from coordinator.state import EpochRecord, EpochState
from coordinator.zk import dump, read_json
from twophase.checkpoint import completed_epochs
from twophase.signing import Signer
from twophase.sink import CommitFailed, TwoPhaseCommitSink

log = logging.getLogger("twophase.coordinator")


@dataclass
class CommitPolicy:
    """How hard phase two tries before it records a failure and moves on to the next round."""

    attempts: int = 5
    max_backoff: float = 5.0
    retain_epochs: int = 10   # committed epoch records kept for `twophase status`
    poll_interval: float = 2.0
    max_commit_threads: int = 16  # upper bound on the sink's own commit_concurrency


@dataclass
class PassOptions:
    """How one reconcile pass behaves; the defaults are the coordinator's loop."""

    recovering: bool = False        # use recover_and_commit / recover_and_abort
    dry_run: bool = False           # report, change nothing
    abort_incomplete: bool = False  # no query runs: abort every pre-commit of incomplete epochs
    retry_failed: bool = False      # put FAILED epochs back to COMMITTING
    checkpoint: str | None = None   # read commits/N here instead of the recorded location
    actions: list[str] = field(default_factory=list)


def publish_app(client: KazooClient, paths: AppPaths, signer: Signer, sink: TwoPhaseCommitSink, mode: str) -> None:
    """Store the app's coordinator mode and its sink, signed, where any coordinator can load it."""
    client.retry(client.ensure_path, paths.sink)
    client.retry(client.set, paths.base, dump({"coordinator": mode}))
    client.retry(client.set, paths.sink, signer.dumps(sink))


class AppCoordinator:
    def __init__(self, client: KazooClient, root: str, app: str, signer: Signer,
                 owner: str, policy: CommitPolicy | None = None,
                 wake: threading.Event | None = None) -> None:
        self.client = client
        self.app = app
        self.paths = AppPaths(root, app)
        self.fence = Fence(client, self.paths.fence)
        self.signer = signer
        self.owner = owner
        self.policy = policy or CommitPolicy()
        self.wake = wake or threading.Event()
        self._sink: TwoPhaseCommitSink | None = None
        self._sink_version: int | None = None
        self._sink_checked = False  # per pass: the stored sink is read at most once
        self._watched: set[str] = set()
        self._unclean: set[tuple[str, int]] = set()  # committed epochs whose dead attempts await cleanup

    def acquire(self) -> None:
        token = self.fence.acquire(self.owner)
        log.info("app %s: %s owns phase two (fence token %d)", self.app, self.owner, token)

    # -- the loop ---------------------------------------------------------

    def prepare(self) -> None:
        """Take ownership and watch the app, so that changes wake the loop."""
        self.acquire()
        self.client.retry(self.client.ensure_path, self.paths.queries)
        ChildrenWatch(self.client, self.paths.queries, self._watch_queries)

    def run(self, stop: threading.Event) -> None:
        """Reconcile on every wake-up (watch, listener) and every poll interval, until stopped or fenced."""
        self.prepare()
        while not stop.is_set():
            self.wake.clear()
            self.reconcile_logged()
            self.wake.wait(self.policy.poll_interval)

    def reconcile_logged(self) -> None:
        """One reconcile pass for a long-running loop: transient trouble is logged, fencing is raised."""
        try:
            self.reconcile()
        except Fenced:
            log.error("app %s: fenced; another coordinator took over, %s stops", self.app, self.owner)
            raise
        except KazooException as e:
            log.warning("app %s: ZooKeeper trouble, retrying: %r", self.app, e)
        except Exception:
            log.exception("app %s: reconcile failed, retrying", self.app)

    def _watch_queries(self, query_ids: list[str]) -> None:
        for qid in set(query_ids) - self._watched:
            self._watched.add(qid)
            qp = self.paths.query(qid)
            self.client.ensure_path(qp.epochs)
            ChildrenWatch(self.client, qp.epochs, lambda _: self.wake.set())
            DataWatch(self.client, qp.barrier, lambda *_: self.wake.set())
        self.wake.set()

    # -- reconcile --------------------------------------------------------

    def reconcile(self, options: PassOptions | None = None) -> list[str]:
        """One pass over every query of the app; returns what it did (or would do), for the CLI."""
        options = options or PassOptions()
        self._sink_checked = False
        try:
            query_ids = self.client.retry(self.client.get_children, self.paths.queries)
        except NoNodeError:
            return options.actions
        for qid in sorted(query_ids):
            self._reconcile_query(qid, self.paths.query(qid), options)
        return options.actions

    def _reconcile_query(self, qid: str, qp: QueryPaths, options: PassOptions) -> None:
        try:
            names = self.client.retry(self.client.get_children, qp.epochs)
        except NoNodeError:
            return
        epochs = sorted(int(n) for n in names)
        watermark = read_json(self.client, qp.watermark, {"epoch": -1})["epoch"]
        if not options.dry_run:
            self._retry_cleanups(qid, qp, options)
            self._collect_garbage(qp, [n for n in epochs if n <= watermark], options)
        pending = [n for n in epochs if n > watermark]
        if not pending:
            return
        barrier = read_json(self.client, qp.barrier, {"epoch": -1})["epoch"]
        in_checkpoint = self._checkpoint_epochs(options.checkpoint or read_json(self.client, qp.base, {}).get("checkpoint"))
        registry = PrecommitRegistry(self.client, qp, self.signer)
        for epoch in pending:
            complete = epoch < epochs[-1] or epoch <= barrier or epoch in in_checkpoint
            raw, stat = self.client.retry(self.client.get, qp.epoch(epoch))
            record = EpochRecord.decode(raw)
            attempts = registry.load(epoch)
            if record.state is EpochState.FAILED:
                if not options.retry_failed:
                    log.error("app %s epoch %d is FAILED (%s); later epochs wait: run `twophase recover "
                              "--retry-failed`", self.app, epoch, record.error)
                    options.actions.append(f"epoch {epoch}: FAILED ({record.error}), blocks later epochs")
                    return
                record = self._decide(qp, epoch, record.to(EpochState.COMMITTING, error=None), stat.version, options)
                if record is None:
                    return
            if not complete:
                self._abort_incomplete(qp, epoch, attempts, options, registry)
                return
            if not self._phase_two(qid, qp, epoch, record, stat.version, attempts, options, registry):
                return

    def _checkpoint_epochs(self, checkpoint: str | None) -> set[int]:
        if not checkpoint:
            return set()
        try:
            return set(completed_epochs(checkpoint))
        except (OSError, ValueError) as e:
            log.warning("app %s: cannot read checkpoint %s: %s", self.app, checkpoint, e)
            return set()

    def _abort_incomplete(self, qp: QueryPaths, epoch: int, attempts: list[Attempt], options: PassOptions,
                          registry: PrecommitRegistry) -> None:
        """Pre-commits of an epoch that Spark will re-run are never reused.

        Those of runs older than the latest one are aborted at once; with
        abort_incomplete (recovery while no query runs) all of them are.
        """
        latest_run = registry.latest_run(attempts)
        stale = [(a, False) for a in attempts if a.run != latest_run or options.abort_incomplete]
        if self._finish_all(qp, epoch, stale, recovering=True, options=options) and options.abort_incomplete:
            self._abort_unregistered(epoch, attempts, options, registry)

    def _decide(self, qp: QueryPaths, epoch: int, decided: EpochRecord, version: int,
                options: PassOptions) -> EpochRecord | None:
        """Record the decision before acting on it; None if the record changed under us."""
        if options.dry_run:
            return decided
        txn = self.fence.transaction()
        txn.set_data(qp.epoch(epoch), decided.encode(), version=version)
        try:
            self.fence.commit(txn)
        except BadVersionError:
            return None  # the next round re-reads it
        return decided

    def _phase_two(self, qid: str, qp: QueryPaths, epoch: int, record: EpochRecord, version: int,
                   attempts: list[Attempt], options: PassOptions, registry: PrecommitRegistry) -> bool:
        recovering = options.recovering or record.state is not EpochState.OPEN
        if not options.dry_run:
            # A deposed owner must not touch the external system. Past this check, the fenced
            # delete after each commit stops it after at most commit_concurrency (idempotent,
            # decided) commits: those in flight when the first delete is refused.
            self.fence.check()
        if record.state is EpochState.OPEN:
            run = registry.latest_run(attempts)
            winners = tuple(sorted(a.name for a in attempts if a.run == run and a.won))
            record = self._decide(qp, epoch, record.to(EpochState.COMMITTING, run=run, winners=winners),
                                  version, options)
            if record is None:
                return False
        if not self._finish_all(qp, epoch, [(a, a.name in record.winners) for a in attempts], recovering, options):
            return False
        # Before the watermark moves, so that an epoch seen committed has no dead attempt's
        # transaction left open (a log sink's would hold back read_committed readers); but a
        # failing cleanup must not hold back the epoch: it is retried on later passes (and by GC).
        if not self._abort_unregistered(epoch, attempts, options, registry):
            self._unclean.add((qid, epoch))
        if options.dry_run:
            options.actions.append(f"epoch {epoch}: would commit {len(record.winners)} pre-commit(s) of run {record.run}")
            return True
        txn = self.fence.transaction()
        txn.set_data(qp.epoch(epoch), record.to(EpochState.COMMITTED).encode())
        txn.set_data(qp.watermark, dump({"epoch": epoch}))
        self.client.retry(self.client.ensure_path, qp.watermark)
        self.fence.commit(txn)
        log.info("app %s query %s: epoch %d committed (%d partitions from run %s)",
                 self.app, qid, epoch, len(record.winners), record.run)
        options.actions.append(f"epoch {epoch}: committed {len(record.winners)} pre-commit(s) of run {record.run}")
        return True

    def _finish_all(self, qp: QueryPaths, epoch: int, work: list[tuple[Attempt, bool]],
                    recovering: bool, options: PassOptions) -> bool:
        """Commit or abort each (attempt, commit?) pair; False if any failed.

        Up to the sink's ``commit_concurrency`` run at once: an epoch of hundreds of partitions
        would otherwise pay every external round trip in sequence. The first failure stops
        those not yet started, as they would fail the same way.
        """
        if not work:
            return True
        threads = 1 if options.dry_run else min(self.sink().commit_concurrency, self.policy.max_commit_threads,
                                                len(work))
        if threads <= 1:
            return all(self._finish(qp, epoch, attempt, commit, recovering, options) for attempt, commit in work)
        # Once one call finds us fenced (or fails), the rest are not started: a deposed owner makes at
        # most ``threads`` more (idempotent, decided) sink calls, the ones already in flight.
        stop = threading.Event()

        def finish(item: tuple[Attempt, bool]) -> bool:
            if stop.is_set():
                return False
            try:
                done = self._finish(qp, epoch, item[0], item[1], recovering, options)
            except BaseException:
                stop.set()
                raise
            if not done:
                stop.set()
            return done

        with ThreadPoolExecutor(threads, thread_name_prefix=f"twophase-commit-{self.app}") as pool:
            results = list(pool.map(finish, work))
        return all(results)

    def _finish(self, qp: QueryPaths, epoch: int, attempt: Attempt, commit: bool,
                recovering: bool, options: PassOptions) -> bool:
        """Commit or abort one pre-commit with retries, then drop its record. False if it failed."""
        if options.dry_run:
            if not commit:
                options.actions.append(f"epoch {epoch}: would abort {attempt.name}")
            return True
        sink = self.sink()
        if commit:
            operation = sink.recover_and_commit if recovering else sink.commit
        else:
            operation = sink.recover_and_abort if recovering else sink.abort
        try:
            self._retrying()(operation, attempt.handle)
        except Exception as e:
            self._record_failure(qp, epoch, attempt, commit, e)
            return False
        attempt_path = f"{qp.attempts(epoch)}/{attempt.name}"
        txn = self.fence.transaction()
        txn.delete(attempt_path)
        txn.delete(f"{qp.intents(epoch)}/{attempt.name}")
        try:
            self.fence.commit(txn)
        except NoNodeError:
            # No intent (registered by a writer that predates intents) or deleted meanwhile.
            txn = self.fence.transaction()
            txn.delete(attempt_path)
            try:
                self.fence.commit(txn)
            except NoNodeError:
                pass
        if not commit:
            options.actions.append(f"epoch {epoch}: aborted {attempt.name}")
        return True

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_attempt(self.policy.attempts),
            wait=wait_exponential(multiplier=0.05, max=self.policy.max_backoff),
            retry=retry_if_not_exception_type(CommitFailed),
            reraise=True,
        )

    def _abort_unregistered(self, epoch: int, attempts: list[Attempt], options: PassOptions,
                            registry: PrecommitRegistry) -> bool:
        """Have the sink clean up after attempts that began a transaction and never registered it.

        Only once the epoch is settled: until then such an attempt may still be running.
        False if the sink failed (retried on the next pass).
        """
        for ctx in registry.unregistered(epoch, attempts):
            if options.dry_run:
                options.actions.append(f"epoch {epoch}: would abort unregistered attempt {ctx.name}")
                continue
            self.fence.check()
            try:
                self._retrying()(self.sink().abort_unregistered, ctx)
            except Exception as e:
                log.error("app %s epoch %d: cleaning up unregistered attempt %s failed: %r; retried next pass",
                          self.app, epoch, ctx.name, e)
                return False
            registry.drop_intent(ctx)
            options.actions.append(f"epoch {epoch}: aborted unregistered attempt {ctx.name}")
        return True

    def _record_failure(self, qp: QueryPaths, epoch: int, attempt: Attempt, commit: bool, error: Exception) -> None:
        verb = "commit" if commit else "abort"
        path = f"{qp.failures(epoch)}/{attempt.name}"
        previous = read_json(self.client, path, {"count": 0})
        failure = {"operation": verb, "error": repr(error), "count": previous["count"] + self.policy.attempts,
                   "at": time.time(), "permanent": isinstance(error, CommitFailed)}
        log.error("app %s epoch %d: %s of %s failed %d times: %r; epoch stays uncommitted",
                  self.app, epoch, verb, attempt.name, failure["count"], error)
        txn = self.fence.transaction()
        if isinstance(error, CommitFailed):
            raw, stat = self.client.retry(self.client.get, qp.epoch(epoch))
            failed = EpochRecord.decode(raw).to(EpochState.FAILED, error=f"{attempt.name}: {error}")
            txn.set_data(qp.epoch(epoch), failed.encode(), version=stat.version)
        self.client.retry(self.client.ensure_path, qp.failures(epoch))
        try:
            self.client.create(path)
        except NodeExistsError:
            pass
        txn.set_data(path, dump(failure))
        self.fence.commit(txn)

    def _retry_cleanups(self, qid: str, qp: QueryPaths, options: PassOptions) -> None:
        registry = PrecommitRegistry(self.client, qp, self.signer)
        for q, epoch in sorted(self._unclean):
            if q == qid and self._abort_unregistered(epoch, registry.load(epoch), options, registry):
                self._unclean.discard((q, epoch))

    def _collect_garbage(self, qp: QueryPaths, committed: list[int], options: PassOptions) -> None:
        """Drop committed epoch records beyond the retention bound, aborting any late leftovers."""
        registry = PrecommitRegistry(self.client, qp, self.signer)
        for epoch in committed[: max(0, len(committed) - self.policy.retain_epochs)]:
            # Anything registered here after the commit is a zombie attempt: never committed.
            registered = registry.load(epoch)
            if not self._finish_all(qp, epoch, [(a, False) for a in registered], recovering=True, options=options):
                return
            if not self._abort_unregistered(epoch, registered, options, registry):
                return
            self.fence.check()
            self.client.retry(self.client.delete, qp.epoch(epoch), recursive=True)

    # -- the sink ---------------------------------------------------------

    def sink(self) -> TwoPhaseCommitSink:
        """The app's sink as its driver stored it, reloaded when a new driver stores a new one."""
        if not self._sink_checked:
            raw, stat = self.client.retry(self.client.get, self.paths.sink)
            if stat.mzxid != self._sink_version:
                self._sink = self.signer.loads(raw, what=f"sink of app {self.app}")
                self._sink_version = stat.mzxid
            self._sink_checked = True
        return self._sink
