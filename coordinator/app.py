"""Phase two for one app: commit completed epochs exactly once, abort the rest.

An epoch N is complete once Spark has durably finished micro-batch N. Any one
of these proves it, and each alone can be lost, so all are consulted:

- the barrier the driver hook publishes from the query's commit log (fast);
- epoch N+1 begun by a run the driver hook recorded as in order (such a run starts batch N+1
  only after commits/N; ``coordinator/runs.py``);
- ``commits/N``, or any later ``commits/M``, in the query's own checkpoint directory (its ``metadata``
  names the query): a restart runs nothing at or below the highest again.

The run that completed N is the most recently started run that registered for
N: once commits/N exists no later run re-runs N. Its winners are committed; every other
pre-commit of N (losers, earlier runs) is aborted. The decision is written to
ZooKeeper before any commit, so a successor resumes it rather than re-deciding.
If that run's write of N failed (a ``foreachBatch`` function swallowed the error
of ``TwoPhaseBatchSink.write``, which recorded it under ``failed_writes``), N is
marked FAILED instead and none of it is committed: ``twophase replay`` runs it again.

Usage::

    app = AppCoordinator(client, "/twophase", "orders", signer, owner="driver")
    app.prepare()          # fences any previous owner and watches the app (sets app.wake)
    report = app.reconcile()   # one pass; the daemon and the driver's host loop on app.wake,
                               # the recovery CLI runs one after app.acquire()
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import BadVersionError, KazooException, NoNodeError, NodeExistsError
from kazoo.recipe.watchers import ChildrenWatch, DataWatch
from tenacity import Retrying, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from coordinator.fence import Fence, Fenced
from coordinator.layout import AppPaths, QueryPaths
from coordinator.precommits import Attempt, PrecommitRegistry
from coordinator.report import (AbortReason, AttemptAborted, AttemptCleanedUp, EpochBlocked, EpochCommitted,
                                EpochSkipped, Operation, OperationFailed, PassReport, Record, SkipReason)
from coordinator.runs import InOrderRuns
from coordinator.slots import Slot, read_slots, releasable
from coordinator.state import EpochRecord, EpochState
from coordinator.zk import RecordError, children, dump, epoch_numbers, parse_object, read_epoch, read_object
from twophase.checkpoint import belongs_to, checkpoint_query_id, highest_commit, is_completed
from twophase.cli_args import check_positive_seconds
from twophase.signing import Signer
from twophase.sink import AbortFailed, CommitFailed, CommitOutcomeUnknown, TwoPhaseCommitSink, release

log = logging.getLogger("twophase.coordinator")

# After a ready hint (coordinator/layout.py QueryPaths.ready) the loop looks for the epoch's commits/N this
# often (a stat, no ZooKeeper request: only its appearing runs a pass), for at most this long: Spark writes
# it right after the hint, unless the driver dies in between.
READY_POLL = 0.005
READY_WINDOW = 10.0

# A query found settled (every epoch committed) is visited by full passes less and less often while none of its
# watches fires (a new epoch, a barrier, a ready hint do), down to every this many full passes: they are there in
# case a watch was lost, and an app keeps every query it ever ran (a fresh checkpoint is a new query).
SETTLED_VISITS_MAX = 16

# Sink errors that no retry can fix: the handle can never be committed, or was committed and
# can no longer be aborted. Not retried; they mark the epoch FAILED for an operator.
PERMANENT = (CommitFailed, AbortFailed)
_MAX_OPS = 500  # per multi-op: ZooKeeper refuses a request over jute.maxbuffer (1 MiB)


@dataclass
class CommitPolicy:
    """How hard phase two tries before it records a failure and moves on to the next round."""

    attempts: int = 5             # tries per commit, abort or cleanup call in one pass
    max_backoff: float = 5.0
    retain_epochs: int = 10       # committed epoch records kept for `twophase status`
    poll_interval: float = 2.0
    max_commit_threads: int = 16  # upper bound on the sink's own commit_concurrency
    # A finished attempt's slot is released once its epoch is this many epochs below the watermark:
    # a zombie of the attempt must stay paused across that many commits before its slot is reused.
    slot_release_lag: int = 1

    def __post_init__(self) -> None:
        for name, least in (("attempts", 1), ("max_commit_threads", 1), ("retain_epochs", 0), ("slot_release_lag", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")
        check_positive_seconds(self.poll_interval, "poll_interval")  # 0 or NaN: a loop that spins
        check_positive_seconds(self.max_backoff, "max_backoff")


@dataclass(frozen=True)
class PassOptions:
    """How one reconcile pass behaves; the defaults are the coordinator's loop."""

    recovering: bool = False        # use recover_and_commit / recover_and_abort
    dry_run: bool = False           # report, change nothing
    abort_incomplete: bool = False  # no query runs: abort every pre-commit of incomplete epochs
    abort_unproven: frozenset[str] = frozenset()  # with abort_incomplete: these queries' epochs too where no
                                    # checkpoint can tell (Spark may have completed them: queries never to run again)
    retry_failed: bool = False      # put FAILED epochs back to COMMITTING
    checkpoint: str | None = None   # read commits/N here instead of the recorded location


@dataclass(frozen=True)
class EpochWork:
    """One epoch of one query as a pass read it: its record (at ``version``) and registered attempts."""

    paths: QueryPaths
    epoch: int
    record: EpochRecord
    version: int                    # of the epoch znode, for the conditional decision write
    attempts: tuple[Attempt, ...]
    registry: PrecommitRegistry

    @property
    def query_id(self) -> str:
        """The query the epoch belongs to."""
        return self.paths.query_id


@dataclass(frozen=True)
class _Verdict:
    attempt: Attempt
    abort_reason: AbortReason | None  # None: commit it

    @classmethod
    def decided(cls, attempt: Attempt, record: EpochRecord) -> _Verdict:
        """What a COMMITTING record says of an attempt: commit the winners of its run, abort the rest."""
        if attempt.name in record.winners:
            return cls(attempt, None)
        return cls(attempt, AbortReason.LOST if attempt.run == record.run else AbortReason.SUPERSEDED)


class _SettledVisits(NamedTuple):
    """How often full passes visit a query found settled and quiet (:meth:`AppCoordinator._skip_settled`)."""

    every: int  # visited every this many full passes
    due: int    # the full pass that visits it next (AppCoordinator._full_passes)
    began: int  # AppCoordinator._began when it was found settled: an epoch begun since ends the backoff


@dataclass
class _Pass:
    options: PassOptions
    changed_only: bool = False  # woken by a watch: see reconcile
    records: list[Record] = field(default_factory=list)  # appended from commit threads: list.append is atomic
    settled: set[str] = field(default_factory=set)  # queries found with every epoch committed
    # Queries whose only pending epoch is one Spark has not completed yet, in which the pass found nothing
    # to abort or clean up: quiet too, as only a watch (its barrier, the next epoch) or a ready hint's
    # commits/N can change that.
    waiting: set[str] = field(default_factory=set)
    revisit: set[str] = field(default_factory=set)  # never quiet after this pass: a late attempt, a failed cleanup
    watermarks: dict[str, int] = field(default_factory=dict)  # per query, its watermark as this pass left it

    def block(self, record: EpochBlocked, message: str) -> None:
        """An epoch waits for an operator: recorded, and logged unless this is a dry run, whose caller prints the
        records (``twophase recover`` runs one before every real pass: the reason would be logged twice)."""
        if not self.options.dry_run:
            log.error("%s", message)
        self.records.append(record)


def await_work(wake: threading.Event, until: float, apps: Iterable[AppCoordinator]) -> None:
    """A coordinator loop's wait between passes: until ``wake`` is set (a watch, a stop, a ready hint's
    ``commits/N`` appearing: :meth:`AppCoordinator.ready_wait`) or the monotonic time ``until``."""
    while not wake.is_set():
        left = until - time.monotonic()
        if left <= 0:
            return
        polls = [wait for app in apps if (wait := app.ready_wait()) is not None]
        wake.wait(min([left, *polls]))


def publish_app(client: KazooClient, paths: AppPaths, signer: Signer, sink: TwoPhaseCommitSink, mode: str) -> None:
    """Store the app's coordinator mode and its sink, signed, where any coordinator can load it."""
    client.retry(client.ensure_path, paths.sink)
    client.retry(client.set, paths.base, dump({"coordinator": mode}))
    client.retry(client.set, paths.sink, signer.dumps(sink, paths.sink))


def verify_stored_sink(client: KazooClient, paths: AppPaths, signer: Signer) -> None:
    """Check the app's stored sink's signature without unpickling it; SignatureError if it does not
    verify. A sink not published yet passes: there is nothing to load."""
    try:
        raw, _ = client.retry(client.get, paths.sink)
    except NoNodeError:
        return
    signer.verify(raw, paths.sink, what=f"sink of app {paths.app!r}")


def _own_highest_commit(checkpoint: str, query_id: str) -> int:
    """The highest N with ``commits/N`` in ``checkpoint``; OSError if it cannot be read here, ValueError if it is
    malformed or its ``metadata`` names another query."""
    owner = checkpoint_query_id(checkpoint)
    if owner != query_id:
        raise ValueError(f"it belongs to query {owner}")
    return highest_commit(checkpoint)


def _stale_copy(given: str | None, given_highest: int | None, recorded: str | None, query_id: str,
                known_complete: int) -> str | None:
    """Why the operator's checkpoint (recover --checkpoint) cannot decide: it has fewer commits than epochs other
    proofs show Spark completed (``known_complete``: the barrier, the watermark, a later epoch begun in order), or
    the recorded checkpoint is readable here too and disagrees. A copy made before the query's last run ended
    would abort epochs Spark completed since."""
    if given_highest is None or given == recorded:
        return None
    if given_highest < known_complete:
        return (f"--checkpoint {given} has commits up to batch {given_highest}, but Spark completed batch "
                f"{known_complete} (the barrier, the watermark or a later epoch says so): a copy must be made after "
                "the query stopped")
    if not recorded:
        return None
    try:
        highest = _own_highest_commit(recorded, query_id)
    except (OSError, ValueError):
        return None  # not readable here, or another query's: what --checkpoint is for
    if highest > given_highest:
        return (f"--checkpoint {given} has commits up to batch {given_highest}, the recorded checkpoint {recorded} up "
                f"to {highest}: a copy must be made after the query stopped; run `twophase recover` without "
                "--checkpoint")
    if highest < given_highest:
        return (f"--checkpoint {given} has commits up to batch {given_highest}, the recorded checkpoint {recorded}, "
                f"readable here, only up to {highest}: one of them is not the query's checkpoint as it is now (a copy "
                "made before `twophase replay` rewound it, or another directory at the recorded path on this host); "
                "recover where only the current one is readable")
    return None


class AppCoordinator:
    """Runs phase two of one app: the embedded coordinator, a daemon's, or ``twophase recover``.

    Only the latest owner (see :class:`~coordinator.fence.Fence`) changes anything; a deposed
    one gets :class:`~coordinator.fence.Fenced`.

    ::

        app = AppCoordinator(client, "/twophase", "orders", signer, owner="recover host-1")
        app.acquire()
        report = app.reconcile(PassOptions(recovering=True, abort_incomplete=True))
        if not report.ok:
            ...            # an epoch is FAILED or blocked: report.records says which and why
    """

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
        self._queries: list[str] | None = None  # the app's queries as their watch last listed them
        self._unclean: set[tuple[str, int]] = set()  # committed epochs whose dead attempts await cleanup
        # Per query, the watermark its slots were last released at; absent: release on the next pass
        # (a new owner's first pass, or after GC or a cleanup dropped intents).
        self._slots_released: dict[str, int] = {}
        # Per query, the slots read by the last release, by path: a held slot's znode never changes, so
        # only slots claimed since are read again. Cleared on taking ownership.
        self._slots: dict[str, dict[str, Slot]] = {}
        self._failure_lock = threading.Lock()  # concurrent failures of one epoch update its record in turn
        # Per query, how often its watches fired (counted in kazoo's event thread), and the count at which a
        # pass last found it quiet: every epoch committed, nothing to clean up, its slots released at its
        # watermark. A pass woken by a watch (``changed_only``) skips a query whose count has not moved
        # since: nothing can have become due there without a new epoch or barrier, which fire its watches.
        self._stirs: dict[str, int] = {}
        self._quiet_at: dict[str, int] = {}
        self._settled_backoff: dict[str, _SettledVisits] = {}  # per query found settled and quiet
        self._full_passes = 0
        self._began: dict[str, int] = {}  # per query, how often its watch saw an epoch begin (kazoo's thread)
        self._epochs_seen: dict[str, set[str]] = {}  # per query, its epochs as its watch last saw them
        self._committed: dict[str, int] = {}         # per query, the last epoch this coordinator committed
        # Per query, a ready hint: (epoch, look until (monotonic), the pass count when it asked for a pass).
        self._ready: dict[str, tuple[int, float, int | None]] = {}
        self._passes = 0  # passes made, so a hint knows whether the pass it asked for has run
        self._checkpoints: dict[str, str] = {}  # per query, its checkpoint as a pass last read it
        self._unreadable: set[tuple[str, str]] = set()  # (query, checkpoint) found unreadable here: warned once
        # Per query, what this owner knows of it without asking: its epochs and barrier (from their watches), its
        # watermark (only the owner writes it), its checkpoint and replay mark (as the last pass read them).
        # A pass woken by a watch uses them (_recall); cleared on taking ownership.
        self._known: dict[str, dict[str, Any]] = {}
        self._in_order = InOrderRuns(client)  # runs whose next epoch may prove the one before complete
        self._ready_lock = threading.Lock()
        self._closed = False                         # close()d: its watches stop at their next event

    def acquire(self) -> None:
        """Take ownership of the app's phase two, fencing any previous owner.

        The stored sink is verified first (SignatureError, nothing changed): an app whose sink no
        owner could load must not lose its current owner to one.
        """
        self.verify_sink()
        self._slots.clear()  # what a deposed owner read may have been released and claimed again since
        self._quiet_at.clear()
        self._settled_backoff.clear()
        self._known.clear()
        token = self.fence.acquire(self.owner)
        log.info("app %s: %s owns phase two (fence token %d)", self.app, self.owner, token)

    # -- the loop ---------------------------------------------------------

    def prepare(self) -> None:
        """Take ownership and watch the app, so that changes wake the loop."""
        self.acquire()
        self.client.retry(self.client.ensure_path, self.paths.queries)
        ChildrenWatch(self.client, self.paths.queries, self._watch_queries)

    def close(self) -> None:
        """Stop watching the app (a daemon no longer serving it, a driver's hook closing): each watch
        ends at its next event. The sink releases what its phase two kept open."""
        self._closed = True
        with self._ready_lock:
            self._ready.clear()
        if self._sink is not None:
            release(self._sink)

    def reconcile_logged(self, changed_only: bool = False) -> None:
        """One reconcile pass for a long-running loop: transient trouble is logged, fencing is raised."""
        try:
            self.reconcile(changed_only=changed_only)
        except Fenced:
            log.error("app %s: fenced; another coordinator took over, %s stops", self.app, self.owner)
            raise
        except KazooException as e:
            log.warning("app %s: ZooKeeper trouble, retrying: %r", self.app, e)
        except Exception:
            log.exception("app %s: reconcile failed, retrying", self.app)

    def _watch_queries(self, query_ids: list[str]) -> bool | None:
        if self._closed:
            return False  # kazoo drops a watch whose callback returns False
        self._queries = list(query_ids)
        for qid in set(query_ids) - self._watched:
            self._watched.add(qid)
            qp = self.paths.query(qid)
            self.client.ensure_path(qp.epochs)
            ChildrenWatch(self.client, qp.epochs, lambda names, qid=qid: self._on_epochs(qid, names))
            DataWatch(self.client, qp.barrier, lambda data, *_, qid=qid: self._on_barrier(qid, data))
            DataWatch(self.client, qp.ready, lambda data, *_, qid=qid: self._on_ready(qid, data))
        self.wake.set()

    # Watches only wake the loop, and a full pass runs every poll_interval whatever they say: the two
    # filters below save passes that would find nothing to do; they never decide anything.

    def _on_epochs(self, query_id: str, names: list[str]) -> bool | None:
        if self._closed:
            return False
        # An epoch N + 1 appearing may prove N complete (if a run recorded in order began it), unless this
        # coordinator committed N already (the barrier came first); one disappearing (garbage collection,
        # replay discarding) makes nothing due.
        seen, self._epochs_seen[query_id] = self._epochs_seen.get(query_id), set(names)
        known = self._known.setdefault(query_id, {})
        if all(n.isdigit() for n in names):
            known["epochs"] = sorted(int(n) for n in names)
        else:
            known.pop("epochs", None)  # the next pass reads them and reports the bad name
        committed = self._committed.get(query_id, -1)
        new = set(names) - seen if seen is not None else set(names)
        if new:
            # A run began an epoch: full passes visit the query again (they abort superseded runs' pre-commits).
            # Counted, as stirs are: the loop's thread compares, so nothing it writes can undo this.
            self._began[query_id] = self._began.get(query_id, 0) + 1
        if seen is None or any(not n.isdigit() or int(n) > committed + 1 for n in new):
            self._stir(query_id)

    def _on_barrier(self, query_id: str, data: bytes | None) -> bool | None:
        if self._closed:
            return False
        # A barrier at or below the last epoch this coordinator committed tells it nothing new (the epoch
        # was committed when the next one appeared, the usual order).
        try:
            epoch = parse_object(data or b"", "barrier", {}).get("epoch")
        except RecordError:
            epoch = None  # the pass reports it
        known = self._known.setdefault(query_id, {})
        if not data:
            known["barrier"] = -1  # none yet, as read_epoch says
        elif isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= -1:
            known["barrier"] = epoch
        else:
            known.pop("barrier", None)  # the next pass reads it and reports it
        if not isinstance(epoch, int) or epoch > self._committed.get(query_id, -1):
            self._stir(query_id)

    def _on_ready(self, query_id: str, data: bytes | None) -> bool | None:
        if self._closed:
            return False
        # The batch path's writer says Spark is about to write commits/N (twophase/spark/stream_sink.py): the
        # loop looks for it every READY_POLL seconds (ready_wait) until N is committed or READY_WINDOW ends.
        try:
            epoch = parse_object(data or b"", "ready", {}).get("epoch")
        except RecordError:
            return  # a hint only: a bad one is ignored, the barrier and the checkpoint still decide
        if isinstance(epoch, int) and epoch > self._committed.get(query_id, -1):
            with self._ready_lock:
                self._ready[query_id] = (epoch, time.monotonic() + READY_WINDOW, None)
            self.wake.set()  # the loop starts looking (await_work); nothing is due before commits/N

    def ready_wait(self) -> float | None:
        """READY_POLL while a ready hint waits for its epoch's ``commits/N``, else None (the loop's usual
        wait). Looking costs a stat per hint, so the loop calls this between passes (:func:`await_work`),
        not a pass per look. A hint asks for one pass at most: when ``commits/N`` appears (the pass commits
        the epoch), or when no pass has read where the query's checkpoint is yet; a hint no look can
        settle (no checkpoint recorded, not a local one, no pass that could read it) is dropped, and the
        barrier decides, as without a hint."""
        now = time.monotonic()
        waiting = False
        for query_id, hint in list(self._ready.items()):
            epoch, until, asked = hint
            if epoch <= self._committed.get(query_id, -1) or now > until:
                self._drop_hint(query_id, hint)
                continue
            if query_id not in self._checkpoints:
                if asked is not None and self._passes > asked:
                    self._drop_hint(query_id, hint)  # the pass found no pending epoch to read it for
                    continue
                if asked is None:
                    with self._ready_lock:
                        if self._ready.get(query_id) == hint:
                            self._ready[query_id] = (epoch, until, self._passes)
                    self._stir(query_id)
                waiting = True
                continue
            try:
                done = is_completed(self._checkpoints[query_id], epoch)
            except (OSError, ValueError):  # not a local path, or no such directory here
                done = None
            if done is None:  # nothing to look at here: the barrier decides, as without a hint
                self._drop_hint(query_id, hint)
            elif done:
                self._drop_hint(query_id, hint)
                self._stir(query_id)  # the pass this wakes commits the epoch
            else:
                waiting = True
        return READY_POLL if waiting else None

    def _drop_hint(self, query_id: str, hint: tuple[int, float, int | None]) -> None:
        with self._ready_lock:  # kazoo's thread may have put a newer hint meanwhile: keep that one
            if self._ready.get(query_id) == hint:
                del self._ready[query_id]

    def _stir(self, query_id: str) -> None:
        self._changed(query_id)
        self.wake.set()

    def _changed(self, query_id: str) -> None:
        # kazoo's event thread and the loop's (ready_wait) write it; a lost increment still changes it.
        self._stirs[query_id] = self._stirs.get(query_id, 0) + 1

    # -- reconcile --------------------------------------------------------

    def reconcile(self, options: PassOptions | None = None, changed_only: bool = False,
                  all_queries: bool = False) -> PassReport:
        """One pass over every query of the app; returns what it did (or, dry, would do).

        ``changed_only`` (a loop woken by a watch) skips the queries a pass found quiet whose watches
        have not fired since, and takes what the owner knows (:meth:`_recall`) rather than asking; a loop
        still makes a full pass now and then, in case a watch was lost. A full pass skips some of the
        queries it found settled (:meth:`_skip_settled`), unless ``all_queries`` (a pass asked for).
        """
        this_pass = _Pass(options or PassOptions(), changed_only)
        self._sink_checked = False
        if not changed_only:
            self._full_passes += 1
        watched = self._queries if changed_only else None
        try:
            for qid in children(self.client, self.paths.queries) if watched is None else watched:
                stirs = self._stirs.get(qid, 0)  # before the pass: a watch firing during it counts as a change
                began = self._began.get(qid, 0)
                still_quiet = self._quiet_at.get(qid) == stirs
                if still_quiet and (changed_only or (not all_queries and self._skip_settled(qid))):
                    continue
                qp = self.paths.query(qid)
                self._reconcile_query(qp, this_pass)
                # Settled, and (unless dry) _release_slots has released its slots at its watermark.
                quiet = ((qid in this_pass.settled or qid in this_pass.waiting) and qid not in this_pass.revisit
                         and not any(q == qid for q, _ in self._unclean))
                if quiet and not this_pass.options.dry_run:
                    self._quiet_at[qid] = stirs
                else:
                    self._quiet_at.pop(qid, None)
                if quiet and qid in this_pass.settled and not this_pass.options.dry_run:
                    backoff = self._settled_backoff.get(qid)
                    every = min(2 * backoff.every, SETTLED_VISITS_MAX) if still_quiet and backoff and \
                        backoff.began == began else 1
                    self._settled_backoff[qid] = _SettledVisits(every, self._full_passes + every, began)
                else:
                    self._settled_backoff.pop(qid, None)
        finally:
            self._passes += 1
        return PassReport(self.app, this_pass.options.dry_run, tuple(this_pass.records))

    def _skip_settled(self, qid: str) -> bool:
        """Whether a full pass skips a query found settled and quiet since: it is visited every 2nd, 4th, ... up
        to every :data:`SETTLED_VISITS_MAX`-th full pass, as long as none of its watches fires."""
        backoff = self._settled_backoff.get(qid)
        return backoff is not None and backoff.began == self._began.get(qid, 0) and self._full_passes < backoff.due

    def _reconcile_query(self, qp: QueryPaths, this_pass: _Pass) -> None:
        self._settle_epochs(qp, this_pass)
        self._release_slots(qp, this_pass)

    def _recall(self, qp: QueryPaths, this_pass: _Pass, name: str, read: Callable[[], Any],
                watched: bool = False) -> Any:
        """The query's ``name`` as this owner knows it, in a pass woken by a watch; else ``read()``, and
        remembered unless a watch keeps it (``watched``: a pass's read could be older than the watch's
        latest). None is never known: a checkpoint not recorded yet is read again.

        Each known value is safe to use stale: older epochs or a lower barrier only prove less complete;
        the watermark only this owner writes (a COMMITTED epoch above it is taken as committed); a
        checkpoint never moves (its query id is in it); and only a new owner, who fences this one, can
        mark a replay or remove the mark.
        """
        known = self._known.setdefault(qp.query_id, {})
        if this_pass.changed_only and known.get(name) is not None:
            return known[name]
        value = read()
        if not watched:
            known[name] = value
        return value

    def _settle_epochs(self, qp: QueryPaths, this_pass: _Pass) -> None:
        options = this_pass.options
        epochs = self._recall(qp, this_pass, "epochs", lambda: epoch_numbers(self.client, qp.epochs), watched=True)
        watermark = -1
        if epochs:
            watermark = self._recall(qp, this_pass, "watermark", lambda: read_epoch(self.client, qp.watermark))
            this_pass.watermarks[qp.query_id] = watermark
        hint = self._ready.get(qp.query_id)
        if hint is not None and (not epochs or hint[0] <= watermark):
            # Stale: its epoch is committed (a new owner's watch reads the last hint of a query that ended).
            self._drop_hint(qp.query_id, hint)
        if not epochs:
            this_pass.settled.add(qp.query_id)
            return
        registry = PrecommitRegistry(self.client, qp, self.signer)
        if not options.dry_run:
            self._retry_cleanups(qp, registry, this_pass)
            if not self._collect_garbage(qp, registry, [n for n in epochs if n <= watermark], this_pass):
                this_pass.revisit.add(qp.query_id)  # a sink call failed: retried on the next pass, not backed off
        pending = [n for n in epochs if n > watermark]
        if not pending:
            this_pass.settled.add(qp.query_id)
            return
        barrier = self._recall(qp, this_pass, "barrier", lambda: read_epoch(self.client, qp.barrier), watched=True)
        recorded = self._recall(
            qp, this_pass, "checkpoint", lambda: read_object(self.client, qp.base, {}).get("checkpoint"))
        checkpoint = recorded
        if options.checkpoint and belongs_to(options.checkpoint, qp.query_id):
            checkpoint = options.checkpoint  # the operator's (recover --checkpoint) for its own query only
        if checkpoint:
            self._checkpoints[qp.query_id] = checkpoint
        else:  # not recorded yet (the driver's publisher polls): a hint then asks a pass to read it again
            self._checkpoints.pop(qp.query_id, None)
        checkpointed = self._checkpointed(checkpoint, qp.query_id)
        hint = self._ready.get(qp.query_id)
        if hint is not None and hint[0] <= max(barrier, -1 if checkpointed is None else checkpointed):
            self._drop_hint(qp.query_id, hint)  # Spark recorded it: the usual passes and retries take over
        replaying = self._recall(qp, this_pass, "replaying", lambda: read_epoch(self.client, qp.replay))
        if replaying >= 0:
            reason = f"`twophase replay` of epoch {replaying} is unfinished: run it again"
            this_pass.block(EpochBlocked(qp.query_id, pending[0], reason, failed=False),
                            f"app {self.app} query {qp.query_id}: {reason}; phase two waits")
            return
        # Recovery (only) takes any later epoch begun in order as proof of every one below it: a pass of the
        # coordinator's loop stops at the first incomplete epoch, and a look per pending epoch would be a round trip
        # each at every pass of a query whose epochs wait.
        proven = self._proven_by_later_epochs(qp, registry, pending) if options.abort_incomplete else -1
        stale_copy = _stale_copy(checkpoint, checkpointed, recorded, qp.query_id, max(barrier, watermark, proven))
        if stale_copy is not None:
            this_pass.block(EpochBlocked(qp.query_id, pending[0], stale_copy, failed=False),
                            f"app {self.app} query {qp.query_id}: {stale_copy}")
            return
        for index, epoch in enumerate(pending):
            later = index + 1 < len(pending)
            complete = (epoch <= max(barrier, proven) or (checkpointed is not None and epoch <= checkpointed)
                        or (later and not options.abort_incomplete
                            and self._begun_in_order(qp, registry, pending[index + 1])))
            if not complete and this_pass.changed_only:
                # What a visit of an incomplete epoch does (abort superseded runs' pre-commits) is left to the
                # full passes: a pass woken by a watch comes to commit, and Spark has just begun the epoch.
                this_pass.waiting.add(qp.query_id)
                this_pass.records.append(EpochSkipped(qp.query_id, epoch, SkipReason.INCOMPLETE))
                return
            work = self._load(qp, registry, epoch)
            if work is None:
                return
            if work.record.state is EpochState.COMMITTED:
                # Above the known watermark: this owner's commit whose answer was lost (the pass failed). The
                # multi-op that recorded it moved the watermark too.
                self._committed_epoch(qp.query_id, epoch, this_pass)
                continue
            if work.record.state is EpochState.FAILED:
                # An epoch whose write failed was never all written: no retry can commit it, a replay must
                # run it again.
                replay = work.record.replay  # its run's write failed: only a replay brings its rows
                if replay or not options.retry_failed:
                    this_pass.block(EpochBlocked(qp.query_id, epoch, work.record.error, replay),
                                    f"app {self.app} epoch {epoch} is FAILED ({work.record.error}); later epochs "
                                    f"wait: run `twophase {'replay' if replay else 'recover --retry-failed'}`")
                    return
                work = self._decide(work, work.record.transition(EpochState.COMMITTING, error=None), this_pass)
                if work is None:
                    return
            # A decided epoch (COMMITTING, or FAILED and retried) had its proof when it was decided.
            complete = complete or work.record.state is not EpochState.OPEN
            if not complete:
                # Recovery (no query runs) aborts what Spark never completed and goes on to the later epochs, none of
                # which can be complete if this one is not. Without a checkpoint of the query's own readable here,
                # nothing tells whether Spark completed it (commits/N may be where this host cannot see, written
                # just as the driver died): only superseded runs' pre-commits go, unless the operator vouches for
                # the query (recover --abort-unproven QUERY: it will never run again).
                unproven = options.abort_incomplete and checkpointed is None
                vouched = qp.query_id in options.abort_unproven
                before = len(this_pass.records)
                done, kept = self._abort_incomplete(work, this_pass, keep_latest=unproven and not vouched,
                                                    reason=AbortReason.UNPROVEN if unproven else AbortReason.INCOMPLETE)
                if unproven and kept:
                    why = (f"epoch {pending[index + 1]} was begun by no run the driver hook recorded as in order"
                           if later else "no barrier or later epoch proves it complete")
                    where = "unknown" if not checkpoint else "not the query's own or unreadable here"
                    reason = (f"{why}, and the checkpoint is {where}: cannot tell whether Spark completed epoch "
                              f"{epoch}; run `twophase recover --checkpoint DIR` (a copy made after the query "
                              f"stopped), or `--abort-unproven {qp.query_id}` if the query will never run again")
                    this_pass.block(EpochBlocked(qp.query_id, epoch, reason, failed=False),
                                    f"app {self.app} query {qp.query_id}: {reason}")
                    return
                if done and len(this_pass.records) == before:
                    this_pass.waiting.add(qp.query_id)  # nothing done: a zombie's late registration gets a visit
                skipped = SkipReason.UNPROVEN if unproven else SkipReason.INCOMPLETE
                this_pass.records.append(EpochSkipped(qp.query_id, epoch, skipped))
                if options.abort_incomplete:
                    continue
                return
            if not self._phase_two(work, this_pass):
                return

    def _proven_by_later_epochs(self, qp: QueryPaths, registry: PrecommitRegistry, pending: list[int]) -> int:
        """The highest epoch that a later pending one begun by a run recorded in order proves complete, -1 if none:
        Spark had written commits/M - 1 when M began, and a restart resumes after the highest commit."""
        for epoch in reversed(pending[1:]):
            if self._begun_in_order(qp, registry, epoch):
                return epoch - 1
        return -1

    def _begun_in_order(self, qp: QueryPaths, registry: PrecommitRegistry, epoch: int) -> bool:
        """Whether a run the driver hook recorded as in order began ``epoch``: Spark then wrote ``commits/N`` of
        the epoch before it, and no restart runs that one again. A run the hook has not recorded (yet), or
        refused (async progress tracking starts N + 1 with ``commits/N`` in memory only), proves nothing."""
        return self._in_order.any_of(qp, registry.runs_begun(epoch))

    def _load(self, qp: QueryPaths, registry: PrecommitRegistry, epoch: int) -> EpochWork | None:
        """The epoch's record and attempts; None if its record is gone (collected)."""
        try:
            raw, stat = self.client.retry(self.client.get, qp.epoch(epoch))
        except NoNodeError:
            return None
        record = EpochRecord.decode(raw, qp.epoch(epoch))
        return EpochWork(qp, epoch, record, stat.version, tuple(registry.load(epoch)), registry)

    def _checkpointed(self, checkpoint: str | None, query_id: str) -> int | None:
        """The highest N with ``commits/N`` in the query's checkpoint (-1: none yet); None if it cannot be read
        here, or belongs to another query (a fresh query started at the recorded path).

        Every epoch up to it is complete: a restart resumes after the highest ``commits/N`` and runs nothing
        below it again, even where Spark wrote no file of its own (async progress tracking writes one an
        interval)."""
        if not checkpoint:
            return None
        try:
            highest = _own_highest_commit(checkpoint, query_id)
        except (OSError, ValueError) as e:
            if (query_id, checkpoint) not in self._unreadable:  # once: a daemon on another host never reads it
                self._unreadable.add((query_id, checkpoint))
                log.warning("app %s query %s: cannot read checkpoint %s: %s; it proves nothing", self.app, query_id,
                            checkpoint, e)
            return None
        self._unreadable.discard((query_id, checkpoint))
        return highest

    def _abort_incomplete(self, work: EpochWork, this_pass: _Pass, keep_latest: bool = False,
                          reason: AbortReason = AbortReason.INCOMPLETE) -> tuple[bool, list[Attempt]]:
        """Pre-commits of an epoch that Spark will re-run are never reused.

        Those of runs older than the latest one (the newest run that began the epoch) are aborted at
        once, and so are the transactions their dead attempts began without registering: one of those
        may hold what the latest run's attempts write (a PostgreSQL row lock on a key), and the epoch
        could never complete while it does. A zombie of such an attempt that registers later finds its
        intent gone and aborts itself. In recovery (no query runs) all of them are, the latest run's
        pre-commits for ``reason`` unless ``keep_latest``. Returns whether every sink call succeeded (else
        it is retried on the next pass) and the latest run's pre-commits it kept.
        """
        recovering = this_pass.options.abort_incomplete
        unregistered = work.registry.unregistered(work.epoch, work.attempts)
        latest_run = work.registry.latest_run(work.attempts, {ctx.run_id for ctx in unregistered})
        keep = not recovering or keep_latest
        kept = [a for a in work.attempts if keep and a.run == latest_run]
        stale = [_Verdict(a, reason if a.run == latest_run else AbortReason.SUPERSEDED)
                 for a in work.attempts if not (keep and a.run == latest_run)]
        return (self._finish_all(work, stale, recovering=True, this_pass=this_pass)
                and self._abort_unregistered(work, this_pass, None if recovering else latest_run)), kept

    def _decide(self, work: EpochWork, decided: EpochRecord, this_pass: _Pass) -> EpochWork | None:
        """Record the decision before acting on it; None if the record changed under us."""
        if this_pass.options.dry_run:
            return replace(work, record=decided)
        txn = self.fence.transaction()
        txn.set_data(work.paths.epoch(work.epoch), decided.encode(), version=work.version)
        try:
            self.fence.commit(txn)
        except BadVersionError:
            this_pass.records.append(EpochSkipped(work.query_id, work.epoch, SkipReason.CHANGED))
            return None  # the next round re-reads it
        return replace(work, record=decided, version=work.version + 1)

    def _phase_two(self, work: EpochWork, this_pass: _Pass) -> bool:
        dry_run = this_pass.options.dry_run
        recovering = this_pass.options.recovering or work.record.state is not EpochState.OPEN
        if not dry_run and work.record.state is not EpochState.OPEN:
            # A deposed owner must not touch the external system. Past this check (for an OPEN epoch: the
            # fenced write of its decision, before any sink call), every sink call after the first
            # commit_concurrency ones checks again (_finish_all): a deposed owner makes at most that many
            # more (idempotent, decided) commits.
            self.fence.check()
        if work.record.state is EpochState.OPEN:
            failed = self._failed_writes(work)
            run = work.registry.latest_run(work.attempts, failed)
            if run in failed:
                return self._fail_epoch(work, run, failed[run], this_pass)
            winners = tuple(sorted(a.name for a in work.attempts if a.run == run and a.won))
            work = self._decide(work, work.record.transition(EpochState.COMMITTING, run=run, winners=winners), this_pass)
            if work is None:
                return False
        record = work.record
        # Before the watermark moves, so that an epoch seen committed has no dead attempt's
        # transaction left open (a log sink's would hold back read_committed readers); but a
        # failing cleanup must not hold back the epoch: it is retried on later passes (and by GC).
        if not self._abort_unregistered(work, this_pass):
            self._unclean.add((work.query_id, work.epoch))
        if not dry_run and work.query_id not in self._committed:
            self.client.retry(self.client.ensure_path, work.paths.watermark)  # this owner's first commit of the query

        def commit_epoch(txn: TransactionRequest) -> None:
            txn.set_data(work.paths.epoch(work.epoch), record.transition(EpochState.COMMITTED).encode())
            txn.set_data(work.paths.watermark, dump({"epoch": work.epoch}))

        # The epoch is recorded committed in the multi-op that drops its attempts' records: one write per
        # epoch, not one per attempt.
        if not self._finish_all(work, [_Verdict.decided(a, record) for a in work.attempts], recovering, this_pass,
                                then=None if dry_run else commit_epoch):
            return False
        if not dry_run:
            self._committed_epoch(work.query_id, work.epoch, this_pass)
            log.info("app %s query %s: epoch %d committed (%d partitions from run %s)",
                     self.app, work.query_id, work.epoch, len(record.winners), record.run)
        this_pass.records.append(EpochCommitted(work.query_id, work.epoch, record.run, record.winners, dry_run))
        return True

    def _committed_epoch(self, query_id: str, epoch: int, this_pass: _Pass) -> None:
        """What this owner knows once ``epoch`` is recorded committed: the query's watermark."""
        self._committed[query_id] = epoch
        this_pass.watermarks[query_id] = epoch
        self._known.setdefault(query_id, {})["watermark"] = epoch

    def _failed_writes(self, work: EpochWork) -> dict[str, str]:
        """The runs whose write of a complete epoch failed (``TwoPhaseBatchSink.write``), with their errors.

        Such a record is never missed: the driver writes it before the failed write raises, so before the
        foreachBatch function returns, and Spark writes ``commits/N`` only after that (the barrier, read from
        the commit log, and epoch N + 1 come later still). So whatever told this pass that N is complete was
        written after the record; the sync brings this client's ZooKeeper server up to date first, so that a
        lagging follower cannot hide a record written through another server.
        """
        self.client.retry(self.client.sync, work.paths.epoch(work.epoch))
        return work.registry.failed_writes(work.epoch)

    def _fail_epoch(self, work: EpochWork, run: str, error: str, this_pass: _Pass) -> bool:
        """The write of the run that completed the epoch failed: record it FAILED (never committed: some of its
        partitions have no pre-commit), then abort the pre-commits it has (one that fails to abort is left to
        ``twophase replay``, which aborts the epoch's pre-commits first). False: later epochs wait."""
        error = (f"the write of run {run} failed ({error}); no row of the epoch is committed: stop the query, "
                 f"then run `twophase replay --app {self.app} --epoch {work.epoch}` with its checkpoint")
        failed = self._decide(work, work.record.transition(EpochState.FAILED, run=run, error=error, replay=True),
                              this_pass)
        if failed is None:
            return False
        aborts = [_Verdict(a, AbortReason.WRITE_FAILED) for a in work.attempts]
        # The failed partitions' attempts are over (their job failed): what they began goes now, not at the
        # replay, so that a log sink's open transactions do not hold back readers meanwhile.
        if self._finish_all(failed, aborts, recovering=True, this_pass=this_pass):
            self._abort_unregistered(failed, this_pass)
        this_pass.block(EpochBlocked(work.query_id, work.epoch, error, replay=True),
                        f"app {self.app} query {work.query_id}: epoch {work.epoch} is FAILED: {error}")
        return False

    def _finish_all(self, work: EpochWork, verdicts: list[_Verdict], recovering: bool, this_pass: _Pass,
                    then: Callable[[TransactionRequest], None] | None = None) -> bool:
        """Commit or abort each attempt as its verdict says, dropping the records of those that succeeded;
        False if any failed. ``then`` adds its operations to the last multi-op that drops them, made only if
        every call succeeded.

        Up to the sink's ``commit_concurrency`` (``threads``) run at once: an epoch of hundreds of partitions
        would otherwise pay every external round trip in sequence. The first failure stops
        those not yet started, as they would fail the same way. Records are dropped once ``threads`` calls
        finished and more are to come, and the rest with ``then``: an epoch of at most ``threads`` attempts
        costs one write, and at most about ``threads`` finished attempts keep their records at any time (a
        crash leaves them to be finished again: replay tells a committed attempt by its records being gone).
        """
        dry_run = this_pass.options.dry_run
        threads = 1 if dry_run or len(verdicts) <= 1 else min(
            self.sink().commit_concurrency, self.policy.max_commit_threads, len(verdicts))
        undropped: list[Attempt] = []  # finished, their records not dropped yet
        left = len(verdicts)
        lock = threading.Lock()

        def finish(index: int, verdict: _Verdict) -> bool:
            nonlocal left
            # The first ``threads`` calls start together, right after the caller's fence check (or the
            # multi-op that decided the epoch); each later one checks first. So a deposed owner makes at
            # most ``threads`` more (idempotent, decided) sink calls: the ones already in flight.
            if index >= threads and not dry_run:
                self.fence.check()
            if not self._finish(work, verdict, recovering, this_pass):
                return False
            with lock:
                undropped.append(verdict.attempt)
                left -= 1
                wave = list(undropped) if left and len(undropped) >= threads and not dry_run else []
                if wave:
                    undropped.clear()
            if wave:
                self._drop_records(work, wave, None)
            return True

        try:
            if threads <= 1:
                ok = all(finish(index, verdict) for index, verdict in enumerate(verdicts))
            else:
                ok = self._finish_concurrently(finish, verdicts, threads)
        except BaseException:
            if undropped and not dry_run:
                self._drop_quietly(work, undropped)
            raise
        if not dry_run and (undropped or (ok and then is not None)):
            self._drop_records(work, undropped, then if ok else None)
        return ok

    def _finish_concurrently(self, finish: Callable[[int, _Verdict], bool], verdicts: list[_Verdict],
                             threads: int) -> bool:
        """``finish`` each verdict (with its index) on ``threads`` threads; once one fails (or finds us
        fenced), the rest are not started."""
        stop = threading.Event()

        def finish_unless_stopped(index: int, verdict: _Verdict) -> bool:
            if stop.is_set():
                return False
            try:
                done = finish(index, verdict)
            except BaseException:
                stop.set()
                raise
            if not done:
                stop.set()
            return done

        with ThreadPoolExecutor(threads, thread_name_prefix=f"twophase-commit-{self.app}") as pool:
            return all(list(pool.map(finish_unless_stopped, range(len(verdicts)), verdicts)))

    def _drop_quietly(self, work: EpochWork, attempts: list[Attempt]) -> None:
        """Drop finished attempts' records while another error is on its way up: that one is raised."""
        try:
            self._drop_records(work, attempts, None)
        except Exception as e:  # noqa: BLE001 - logged; the error that stopped the calls is raised
            log.warning("app %s epoch %d: dropping the records of %d finished attempts failed too (%r): they are "
                        "finished again by the next pass", self.app, work.epoch, len(attempts), e)

    def _finish(self, work: EpochWork, verdict: _Verdict, recovering: bool, this_pass: _Pass) -> bool:
        """Commit or abort one pre-commit with retries. False if it failed."""
        attempt, reason, dry_run = verdict.attempt, verdict.abort_reason, this_pass.options.dry_run
        if dry_run:
            if reason is not None:
                this_pass.records.append(AttemptAborted(work.query_id, work.epoch, attempt.name, reason, dry_run))
            return True
        sink = self.sink()
        if reason is None:
            operation, call = Operation.COMMIT, sink.recover_and_commit if recovering else sink.commit
        else:
            operation, call = Operation.ABORT, sink.recover_and_abort if recovering else sink.abort
        tries, error = self._call(call, attempt.handle)
        if error is not None:
            self._record_failure(work, attempt.name, operation, error, tries, this_pass)
            return False
        if reason is not None:
            this_pass.records.append(AttemptAborted(work.query_id, work.epoch, attempt.name, reason))
        return True

    def _drop_records(self, work: EpochWork, attempts: list[Attempt],
                      then: Callable[[TransactionRequest], None] | None) -> None:
        """Delete the attempt and intent znodes of finished attempts in fenced multi-ops, ``then``'s operations
        in the last one. A znode deleted meanwhile (a loser's own ``forget``: its attempt, then its intent)
        fails a multi-op as a whole: those still there are deleted again."""
        paths = [f"{folder}/{a.name}" for a in attempts
                 for folder in (work.paths.attempts(work.epoch), work.paths.intents(work.epoch))]
        room = (_MAX_OPS - 3) // 2 * 2  # the fence check and then's operations; an attempt's pair in one chunk
        for tries in itertools.count(1):
            try:
                for start in range(0, max(len(paths), 1), room):
                    txn = self.fence.transaction()
                    for path in paths[start:start + room]:
                        txn.delete(path)
                    if then is not None and start + room >= len(paths):
                        then(txn)
                    self.fence.commit(txn)
                return
            except NoNodeError:
                if tries == 3:
                    raise
                pending = [(path, self.client.exists_async(path)) for path in paths]
                paths = [path for path, found in pending if found.get() is not None]

    def _call(self, call: Callable[[Any], None], argument: Any) -> tuple[int, Exception | None]:
        """Call with the policy's retries (none after a PERMANENT error): the tries made and the last error."""
        tries = 0

        def counted() -> None:
            nonlocal tries
            tries += 1
            call(argument)

        retrying = Retrying(
            stop=stop_after_attempt(self.policy.attempts),
            wait=wait_exponential(multiplier=0.05, max=self.policy.max_backoff),
            retry=retry_if_not_exception_type(PERMANENT),
            reraise=True,
        )
        try:
            retrying(counted)
        except Exception as e:  # whatever the sink raises: recorded, and retried on a later pass
            return tries, e
        return tries, None

    def _abort_unregistered(self, work: EpochWork, this_pass: _Pass, running: str | None = None) -> bool:
        """Have the sink clean up after attempts that began a transaction and never registered it.

        Only once the epoch is settled, or for runs older than the ``running`` one: until then such
        an attempt may still be running. False if the sink failed (retried on the next pass).
        """
        dry_run = this_pass.options.dry_run
        for ctx in work.registry.unregistered(work.epoch, work.attempts):
            if ctx.run_id == running:
                continue
            if not dry_run:
                self.fence.check()
                tries, error = self._call(self.sink().abort_unregistered, ctx)
                if error is not None:
                    log.error("app %s epoch %d: cleaning up unregistered attempt %s failed %d times: %r; "
                              "retried next pass", self.app, work.epoch, ctx.name, tries, error)
                    this_pass.records.append(OperationFailed(work.query_id, work.epoch, ctx.name, Operation.CLEANUP,
                                                             repr(error), tries, isinstance(error, PERMANENT)))
                    return False
                if not work.registry.drop_unregistered_intent(ctx):
                    this_pass.revisit.add(work.query_id)  # the next pass must see what it registered
                    continue  # it registered meanwhile: a zombie's handle, aborted as late with the epoch
            this_pass.records.append(AttemptCleanedUp(work.query_id, work.epoch, ctx.name, dry_run))
        return True

    def _record_failure(self, work: EpochWork, attempt: str, operation: Operation, error: Exception,
                        tries: int, this_pass: _Pass) -> None:
        """Store the failure for `twophase status`; a PERMANENT one also marks the epoch FAILED."""
        permanent = isinstance(error, PERMANENT)
        path = f"{work.paths.failures(work.epoch)}/{attempt}"
        with self._failure_lock:
            try:
                previous = read_object(self.client, path, {"count": 0})
                previous["count"] = int(previous.get("count", 0))
            except (RecordError, TypeError, ValueError) as e:  # rewritten below: must not stop phase two
                log.warning("app %s: failure record %s unreadable (%s); its try count restarts", self.app, path, e)
                previous = {"count": 0}
            failure = {"operation": operation.value, "error": repr(error), "count": previous["count"] + tries,
                       "at": time.time(), "permanent": permanent,
                       "outcome_unknown": isinstance(error, CommitOutcomeUnknown)}
            log.error("app %s epoch %d: %s of %s failed %d times (%d in all): %r; epoch stays uncommitted",
                      self.app, work.epoch, operation.value, attempt, tries, failure["count"], error)
            txn = self.fence.transaction()
            if permanent:
                raw, stat = self.client.retry(self.client.get, work.paths.epoch(work.epoch))
                current = EpochRecord.decode(raw, work.paths.epoch(work.epoch))
                # Only a decided epoch: not an OPEN one (a stale pre-commit's abort), not a COMMITTED one (a
                # late attempt's abort, in GC), not twice.
                if current.state is EpochState.COMMITTING:
                    failed = current.transition(EpochState.FAILED, error=f"{attempt}: {error}")
                    txn.set_data(work.paths.epoch(work.epoch), failed.encode(), version=stat.version)
            self.client.retry(self.client.ensure_path, work.paths.failures(work.epoch))
            try:
                self.client.create(path)
            except NodeExistsError:
                pass
            txn.set_data(path, dump(failure))
            self.fence.commit(txn)
        this_pass.records.append(OperationFailed(work.query_id, work.epoch, attempt, operation, repr(error),
                                                 tries, permanent))

    def _retry_cleanups(self, qp: QueryPaths, registry: PrecommitRegistry, this_pass: _Pass) -> None:
        for qid, epoch in sorted(self._unclean):
            if qid != qp.query_id:
                continue
            work = self._load(qp, registry, epoch)
            if work is None or self._abort_unregistered(work, this_pass):
                self._unclean.discard((qid, epoch))
                self._slots_released.pop(qid, None)  # intents dropped: their slots may be free

    def _collect_garbage(self, qp: QueryPaths, registry: PrecommitRegistry, committed: list[int],
                         this_pass: _Pass) -> bool:
        """Drop committed epoch records beyond the retention bound, aborting any late leftovers. False if a
        sink call failed (retried on the next pass)."""
        for epoch in committed[: max(0, len(committed) - self.policy.retain_epochs)]:
            work = self._load(qp, registry, epoch)
            if work is None:
                continue
            # Anything registered here after the commit is a zombie attempt: never committed.
            late = [_Verdict(a, AbortReason.LATE) for a in work.attempts]
            done = len(this_pass.records)
            if not (self._finish_all(work, late, recovering=True, this_pass=this_pass)
                    and self._abort_unregistered(work, this_pass) and self._retire(work, this_pass)):
                return False
            # Intents dropped here (late aborts, cleanups: each recorded) or with the tree free their slots
            # for the next release; an epoch whose commit dropped them all frees nothing new.
            if self._delete_epoch(qp, epoch) or len(this_pass.records) > done:
                self._slots_released.pop(qp.query_id, None)
        return True

    def _retire(self, work: EpochWork, this_pass: _Pass) -> bool:
        """Tell the sink the epoch is past retention, before its record goes: a failed call keeps the
        record (and is retried next pass), so the sink never forgets an epoch phase two may still call."""
        if this_pass.options.dry_run:
            return True
        self.fence.check()
        tries, error = self._call(lambda epoch: self.sink().retire_epoch(self.app, work.query_id, epoch), work.epoch)
        if error is None:
            return True
        log.error("app %s epoch %d: retiring the epoch in the sink failed %d times: %r; retried next pass",
                  self.app, work.epoch, tries, error)
        this_pass.records.append(OperationFailed(work.query_id, work.epoch, "", Operation.RETIRE, repr(error),
                                                 tries, isinstance(error, PERMANENT)))
        return False

    def _delete_epoch(self, qp: QueryPaths, epoch: int) -> bool:
        """Delete an epoch's record and everything under it (``intents``, ``attempts``, ``winners``,
        ``failures`` and their children) in fenced multi-ops, children first; True if it held intents.
        One write where a
        recursive delete made a round trip per znode. A znode deleted meanwhile (a loser's own
        ``forget``) makes the multi-op fail as a whole: the tree is listed again and deleted again.
        A znode created meanwhile (a zombie registering) fails it too, with NotEmptyError: the pass
        fails and the next one aborts the zombie's pre-commit as late before deleting the epoch."""
        base = qp.epoch(epoch)
        intents = qp.intents(epoch)
        for tries in itertools.count(1):
            listed = [(f"{base}/{name}", self.client.get_children_async(f"{base}/{name}"))
                      for name in children(self.client, base)]
            doomed = []
            for folder, names in listed:
                try:
                    doomed += [f"{folder}/{name}" for name in names.get()]
                except NoNodeError:
                    continue
                doomed.append(folder)
            doomed.append(base)
            try:
                for start in range(0, len(doomed), _MAX_OPS):
                    txn = self.fence.transaction()
                    for path in doomed[start:start + _MAX_OPS]:
                        txn.delete(path)
                    self.fence.commit(txn)
                return any(path.startswith(f"{intents}/") for path in doomed)
            except NoNodeError:
                if not self.client.exists(base):
                    return True  # gone already (an earlier try whose answer was lost): assume it held some
                if tries == 3:
                    raise

    def _release_slots(self, qp: QueryPaths, this_pass: _Pass) -> None:
        """Release the slots of finished attempts ``slot_release_lag`` epochs below the watermark.

        Only when the watermark moved since the last release, or intents were dropped outside an
        epoch's commit: otherwise nothing can have become free. A dry run only reads them (a
        malformed one is a RecordError before `twophase recover` takes ownership).
        """
        dry_run = this_pass.options.dry_run
        watermark = this_pass.watermarks.get(qp.query_id)
        if watermark is None:  # the pass found no epoch record, so did not read it
            watermark = read_epoch(self.client, qp.watermark)
        if self._slots_released.get(qp.query_id) == watermark:
            return
        if this_pass.changed_only and self._slots.get(qp.query_id) == {} and not self.sink().uses_slots:
            # None held at the last read, and the stored sink's tasks claim none (a full pass lists them again:
            # tasks of an earlier sink may still run).
            self._slots_released[qp.query_id] = watermark
            return
        held = read_slots(self.client, qp, self._slots.get(qp.query_id))
        free = releasable(self.client, qp, held, watermark, self.policy.slot_release_lag)
        if dry_run:
            return
        for start in range(0, len(free), _MAX_OPS):
            txn = self.fence.transaction()
            for slot in free[start:start + _MAX_OPS]:
                txn.delete(slot.path(qp), version=slot.version)
            self.fence.commit(txn)
        if free:
            log.debug("app %s query %s: released %d slots", self.app, qp.query_id, len(free))
        self._slots[qp.query_id] = {slot.path(qp): slot for slot in set(held) - set(free)}
        self._slots_released[qp.query_id] = watermark

    # -- the sink ---------------------------------------------------------

    def discard_epochs(self, query_id: str, first: int) -> PassReport:
        """Abort every pre-commit of the query's epochs from ``first`` on, clean up after their dead
        attempts and delete their records, as if Spark had never run them (``twophase replay``, before
        it rewinds the checkpoint). Earliest first: an abort of epoch ``first`` that finds a handle
        committed stops it before any later epoch is touched; it stops at the first sink call that
        fails (run it again)."""
        this_pass = _Pass(PassOptions(recovering=True))
        qp = self.paths.query(query_id)
        registry = PrecommitRegistry(self.client, qp, self.signer)
        for epoch in [n for n in epoch_numbers(self.client, qp.epochs) if n >= first]:
            work = self._load(qp, registry, epoch)
            if work is None:
                continue
            replayed = [_Verdict(a, AbortReason.REPLAYED) for a in work.attempts]
            if not (self._finish_all(work, replayed, recovering=True, this_pass=this_pass)
                    and self._abort_unregistered(work, this_pass)):
                break
            self._delete_epoch(qp, epoch)
        return PassReport(self.app, False, tuple(this_pass.records))

    def verify_sink(self) -> None:
        """Check the stored sink's signature without unpickling it; SignatureError if it does not verify.

        A sink not published yet passes: there is nothing to load, and :meth:`sink` reports it when needed.
        """
        verify_stored_sink(self.client, self.paths, self.signer)

    def sink(self) -> TwoPhaseCommitSink:
        """The app's sink as its driver stored it, reloaded when a new driver stores a new one."""
        if not self._sink_checked:
            raw, stat = self.client.retry(self.client.get, self.paths.sink)
            if stat.mzxid != self._sink_version:
                replaced = self._sink
                self._sink = self.signer.loads(raw, self.paths.sink, what=f"sink of app {self.app!r}")
                self._sink_version = stat.mzxid
                if replaced is not None:
                    release(replaced)
            self._sink_checked = True
        return self._sink
