"""The `twophase` command: status, recovery and the HA coordinator daemon.

    twophase status --zk HOSTS --app NAME [--root /twophase] [--json]
    twophase recover --zk HOSTS --app NAME [--checkpoint DIR] [--abort-unproven QUERY_ID] [--dry-run] [--retry-failed]
                     [--json]
    twophase replay --zk HOSTS --app NAME --checkpoint DIR --epoch N [--dry-run]
    twophase coordinator --zk HOSTS [--root /twophase]
    twophase broker --data-dir DIR [--port 9092] [--security-protocol SASL_SSL ...]
    twophase broker-users add|remove|list --users-file FILE [NAME]
    twophase txns --bootstrap-server HOST:PORT [--command-config FILE] list|describe|abort

Exit codes of status and recover: 0 fine; 1 an epoch is FAILED or blocked, or (recover) a sink
call failed; 2 the command could not run or found the app's records unusable (a bad option, no such
app, bad checkpoint, a sink or pre-commit whose signature does not verify, a znode holding data
twophase did not write, ZooKeeper unreachable, another coordinator took over). ``recover`` reads
and verifies everything it will act on before it takes ownership of the app: on exit 2 for
those reasons it has changed nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

from coordinator.app import AppCoordinator, CommitPolicy, PassOptions
from coordinator.daemon import CoordinatorDaemon
from coordinator.fence import Fenced
from coordinator.layout import DEFAULT_ROOT, AppPaths
from coordinator.replay import ReplayRefused, plan_replay, replay
from coordinator.report import (AbortReason, AttemptAborted, AttemptCleanedUp, EpochBlocked, EpochCommitted,
                                EpochSkipped, Operation, OperationFailed, Record, SkipReason, as_json)
from coordinator.status import AppStatus, read_status
from coordinator.zk import RecordError, children, connect, read_epoch
from twophase.broker.cli import add_broker_parser, add_users_parser
from twophase.checkpoint import checkpoint_query_id
from twophase.cli_args import app_name, int_from, positive_int, positive_seconds
from twophase.client.cli import add_txns_parser
from twophase.signing import SignatureError, Signer, load_secret


class CliError(Exception):
    """A failure the user can act on; printed without a traceback, exit code 2."""


def _age(seconds_since_epoch: float | None) -> str:
    if seconds_since_epoch is None:
        return "?"
    return f"{max(0.0, time.time() - seconds_since_epoch):.0f}s"


def _require_app(client: KazooClient, paths: AppPaths) -> None:
    if not client.exists(paths.base):
        raise CliError(f"no app {paths.app!r} under {paths.root}")


def _checkpoint_query_id(checkpoint: str) -> str:
    try:
        return checkpoint_query_id(checkpoint)
    except (OSError, ValueError) as e:
        raise CliError(f"{checkpoint} is not a Spark streaming checkpoint: {e}") from e


def _print_json(data: dict) -> None:
    print(json.dumps(data, indent=2))


# -- status -----------------------------------------------------------------

def cmd_status(args: argparse.Namespace, client: KazooClient, signer: Signer) -> int:
    """``twophase status``: print the app's state; exit code 1 if an epoch is FAILED."""
    paths = AppPaths(args.root, args.app)
    _require_app(client, paths)
    status = read_status(client, paths, signer, None if args.no_prepared else args.prepared_older_than)
    if args.json:
        _print_json(as_json(status))
    else:
        print_status(status)
    if status.sink_error:
        print(f"twophase status: sink signature invalid: {status.sink_error}", file=sys.stderr)
        return 2
    return 1 if status.failed_epochs else 0


def print_status(status: AppStatus) -> None:
    """Word an app's state for people: runs, unsettled epochs with their attempts and failures."""
    print(f"app {status.app}  coordinator: {status.coordinator or '?'}  owner: {status.owner or '-'}")
    if status.sink_error:
        print(f"  SINK SIGNATURE INVALID: {status.sink_error}")
    for query in status.queries:
        print(f"  query {query.query_id}\n    checkpoint: {query.checkpoint or 'unknown'}")
        print(f"    committed watermark: {query.watermark}   spark barrier: {query.barrier}")
        if query.slots:
            print("    slots held: " + ", ".join(f"partition {p}: {n}" for p, n in query.slots))
        for run in query.runs:
            print(f"    run {run.run_id}  {'alive' if run.alive else 'ended'}  started {_age(run.started)} ago")
            if run.halted:
                print(f"      HALTED: {run.halted}")
        for epoch in query.epochs:
            if epoch.committed and not epoch.attempts and not epoch.failures:
                continue  # committed and settled: not worth a line
            print(f"    epoch {epoch.epoch}: {epoch.state.value}" + (f"  error: {epoch.error}" if epoch.error else ""))
            for a in epoch.attempts:
                print(f"      {a.name}  partition {a.partition} attempt {a.attempt}  {'winner' if a.won else 'loser'}  "
                      f"{'in-doubt' if a.in_doubt else 'pending'}  age {_age(a.registered)}")
            for f in epoch.failures:
                print(f"      FAILURE {f.attempt}: {f.operation} x{f.count}: {f.error}")
    if status.prepared_error:
        print(f"  PREPARED TRANSACTIONS UNKNOWN: {status.prepared_error}")
    if status.prepared:
        print(f"  prepared transactions older than the threshold ({len(status.prepared)}; they hold locks and "
              "resources in the target until committed or rolled back):")
        for t in status.prepared:
            owner = f"attempt {t.attempt}" if t.attempt else "not this app's"
            print(f"    {t.id}  age {_age(time.time() - t.age)}  {owner}" + (f"  in {t.where}" if t.where else ""))


# -- recover ----------------------------------------------------------------

_ABORTED_BECAUSE = {
    AbortReason.LOST: "another attempt of its run won the partition",
    AbortReason.SUPERSEDED: "its run did not complete the epoch",
    AbortReason.INCOMPLETE: "Spark never completed the epoch and will re-run it",
    AbortReason.UNPROVEN: "nothing proved the epoch complete, and --abort-unproven named the query",
    AbortReason.LATE: "registered after the epoch was committed",
    AbortReason.REPLAYED: "the epoch is replayed: Spark re-runs it",
    AbortReason.WRITE_FAILED: "the epoch's write failed: the epoch is FAILED",
}
_SKIPPED_BECAUSE = {
    SkipReason.INCOMPLETE: "not completed by Spark; left open",
    SkipReason.UNPROVEN: "nothing proves whether Spark completed it; left open",
    SkipReason.CHANGED: "changed during this pass; left for the next one",
}


def describe(record: Record) -> str:
    """One line for people about one record of a reconcile pass."""
    where = f"query {record.query_id} epoch {record.epoch}"
    dry = getattr(record, "dry_run", False)
    if isinstance(record, EpochCommitted):
        verb = "would commit" if dry else "committed"
        return f"{where}: {verb} {len(record.attempts)} pre-commit(s) of run {record.run}"
    if isinstance(record, AttemptAborted):
        verb = "would abort" if dry else "aborted"
        return f"{where}: {verb} {record.attempt} ({_ABORTED_BECAUSE[record.reason]})"
    if isinstance(record, AttemptCleanedUp):
        verb = "would clean up" if dry else "cleaned up"
        return f"{where}: {verb} after unregistered attempt {record.attempt}"
    if isinstance(record, OperationFailed):
        if record.operation in (Operation.CLEANUP, Operation.RETIRE):
            then = "retried on the next pass"
        elif record.permanent:
            then = "the epoch is now FAILED"
        else:
            then = "the epoch stays uncommitted"
        subject = "the epoch" if record.operation is Operation.RETIRE else record.attempt
        return (f"{where}: {record.operation.value} of {subject} failed "
                f"({record.tries} {'try' if record.tries == 1 else 'tries'}): {record.error}; {then}")
    if isinstance(record, EpochBlocked):
        if not record.failed:  # undecided: the error says what to run
            return f"{where}: waits ({record.error}); every later epoch waits too"
        if record.replay:  # the error says to replay it
            return f"{where}: FAILED ({record.error}); every later epoch waits"
        return (f"{where}: FAILED ({record.error}); it and every later epoch wait: "
                f"fix the cause, then run `twophase recover --retry-failed`")
    if isinstance(record, EpochSkipped):
        return f"{where}: {_SKIPPED_BECAUSE[record.reason]}"
    raise TypeError(f"unknown record {record!r}")


def cmd_recover(args: argparse.Namespace, client: KazooClient, signer: Signer) -> int:
    """``twophase recover``: one recovery pass; exit code 1 if an epoch is FAILED or undecided, or a sink call
    failed."""
    paths = AppPaths(args.root, args.app)
    _require_app(client, paths)
    queries = children(client, paths.queries)
    if args.checkpoint:
        qid = _checkpoint_query_id(args.checkpoint)
        if qid not in queries:
            raise CliError(f"checkpoint {args.checkpoint} belongs to query {qid}, which has no state in app {args.app}")
    for qid in args.abort_unproven:
        if qid not in queries:
            raise CliError(f"--abort-unproven {qid}: app {args.app} has no such query (its queries: "
                           f"{', '.join(sorted(queries)) or 'none'})")
    live = [f"{q}/{r}" for q in queries for r in children(client, paths.query(q).runs)
            if client.exists(f"{paths.query(q).run(r)}/alive")] if not args.force else []
    if live:
        raise CliError(f"runs still alive ({', '.join(live)}); recover while no query runs, or pass --force")
    options = PassOptions(recovering=True, dry_run=args.dry_run, abort_incomplete=True,
                          abort_unproven=frozenset(args.abort_unproven), retry_failed=args.retry_failed,
                          checkpoint=args.checkpoint)
    owner = f"recover {socket.gethostname()}:{os.getpid()}"
    with contextlib.closing(AppCoordinator(client, args.root, args.app, signer, owner,
                                           CommitPolicy(attempts=args.attempts))) as app:
        # Everything the pass will act on is read and verified before ownership changes hands: a sink or
        # record that does not verify (SignatureError, RecordError: exit 2) leaves the app's owner in place.
        app.verify_sink()
        if not args.dry_run:
            app.reconcile(dataclasses.replace(options, dry_run=True))
            app.acquire()
        report = app.reconcile(options)
    if args.json:
        _print_json(report.to_json())
    else:
        for line in [describe(r) for r in report.records] or ["nothing to do"]:
            print(("[dry-run] " if args.dry_run else "") + line)
    return 0 if report.ok else 1


def cmd_replay(args: argparse.Namespace, client: KazooClient, signer: Signer) -> int:
    """``twophase replay``: make Spark run a FAILED epoch again; exit 1 if an abort failed (run it again)."""
    paths = AppPaths(args.root, args.app)
    _require_app(client, paths)
    query_id = _checkpoint_query_id(args.checkpoint)
    try:
        plan = plan_replay(read_status(client, paths, signer), query_id, args.epoch, args.checkpoint,
                           read_epoch(client, paths.query(query_id).replay))
    except ReplayRefused as e:
        raise CliError(f"epoch {args.epoch} of query {query_id} cannot be replayed: {e}") from None
    later = f" and the later epochs {', '.join(map(str, plan.later_epochs))}" if plan.later_epochs else ""
    if args.dry_run:
        print(f"[dry-run] would rewind {args.checkpoint} to batch {plan.epoch} and abort the pre-commits of epoch "
              f"{plan.epoch}{later}")
        return 0
    owner = f"replay {socket.gethostname()}:{os.getpid()}"
    with contextlib.closing(AppCoordinator(client, args.root, args.app, signer, owner)) as app:
        app.verify_sink()
        removed, report = replay(app, plan)
    for line in report.records:
        print(describe(line))
    if not report.ok:
        if any(isinstance(r, OperationFailed) and r.permanent for r in report.records):
            print(f"epoch {plan.epoch} is partly committed (an abort found a handle committed): not replayed, "
                  "nothing rewound; it stays FAILED for you to settle (docs/log-sink.md)", file=sys.stderr)
        else:
            print("some pre-commits could not be aborted yet: nothing rewound; run `twophase replay` again",
                  file=sys.stderr)
        return 1
    print(f"removed from the checkpoint: {', '.join(removed) or 'nothing (rewound already)'}")
    print(f"epoch {plan.epoch}{later} discarded; restart the query: Spark runs batch {plan.epoch} again from "
          f"offsets/{plan.epoch}")
    return 0


def cmd_coordinator(args: argparse.Namespace, client: KazooClient, signer: Signer) -> int:
    """``twophase coordinator``: run an HA coordinator daemon until SIGTERM or SIGINT."""
    client.stop()  # the daemon manages its own session
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    CoordinatorDaemon(args.zk, args.root, signer, CommitPolicy(poll_interval=args.poll_interval),
                      session_timeout=args.session_timeout).run(stop)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``twophase`` argument parser, every subcommand included."""
    parser = argparse.ArgumentParser(prog="twophase", description="Exactly-once 2PC sinks for Spark: operations.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, app: bool = True) -> None:
        p.add_argument("--zk", required=True, help="ZooKeeper connection string, e.g. 127.0.0.1:2181")
        p.add_argument("--root", default=DEFAULT_ROOT, help="root znode of twophase state (default %(default)s)")
        p.add_argument("--secret-file", help="file holding the HMAC secret (default: $TWOPHASE_SECRET, "
                                             "$TWOPHASE_SECRET_FILE or ~/.config/twophase/secret)")
        if app:
            p.add_argument("--app", type=app_name, required=True, help="the app name given to TwoPhaseSink")

    p = sub.add_parser("status", help="show runs, epochs, pending and in-doubt transactions, the watermark")
    common(p)
    p.add_argument("--json", action="store_true", help="print the state as JSON")
    p.add_argument("--prepared-older-than", type=positive_seconds, default=300.0, metavar="SECONDS",
                   help="list the sink target's prepared transactions older than this (default %(default)s)")
    p.add_argument("--no-prepared", action="store_true",
                   help="do not load the sink nor ask its target for prepared transactions")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("recover", help="commit the pre-commits of epochs Spark completed, abort those of epochs it "
                                            "did not; an epoch nothing tells about waits")
    common(p)
    p.add_argument("--checkpoint", help="the query's Spark checkpoint directory (default: the recorded one)")
    p.add_argument("--abort-unproven", metavar="QUERY_ID", action="append", default=[],
                   help="also abort this query's pre-commits that nothing proves complete or not (no barrier, no "
                        "later epoch, no checkpoint of the query readable here): only for a query Spark will never "
                        "run again, since it may have completed them (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    p.add_argument("--retry-failed", action="store_true", help="retry epochs marked FAILED")
    p.add_argument("--force", action="store_true", help="run even though a query run looks alive")
    p.add_argument("--attempts", type=positive_int, default=3,
                   help="tries per commit or abort (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")
    p.set_defaults(func=cmd_recover)

    p = sub.add_parser("replay", help="make Spark run a FAILED epoch again from its recorded offsets")
    common(p)
    p.add_argument("--checkpoint", required=True, help="the query's Spark checkpoint directory")
    p.add_argument("--epoch", type=int_from(0), required=True, help="the FAILED epoch (batch id)")
    p.add_argument("--dry-run", action="store_true", help="check and print what would be done, change nothing")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("coordinator", help="run an HA coordinator daemon (leader election among daemons)")
    common(p, app=False)
    p.add_argument("--poll-interval", type=positive_seconds, default=2.0,
                   help="seconds between checkpoint scans (default %(default)s)")
    p.add_argument("--session-timeout", type=positive_seconds, default=10.0,
                   help="ZooKeeper session timeout: how fast a standby takes over a dead leader")
    p.set_defaults(func=cmd_coordinator)

    add_broker_parser(sub).set_defaults(needs_zookeeper=False)
    add_users_parser(sub).set_defaults(needs_zookeeper=False)
    add_txns_parser(sub).set_defaults(needs_zookeeper=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``twophase`` command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    daemon = args.command in ("coordinator", "broker")
    logging.basicConfig(level=logging.INFO if args.verbose or daemon else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "needs_zookeeper", True):
        return args.func(args)
    try:
        with open(args.secret_file) if args.secret_file else contextlib.nullcontext() as f:
            signer = Signer(load_secret(f.read().strip() if f else None))
    except (OSError, ValueError) as e:  # unreadable secret file, a secret too short
        print(f"twophase: secret: {e}", file=sys.stderr)
        return 2
    try:
        client = connect(args.zk, timeout=10)
    except (KazooTimeoutError, ValueError) as e:  # unreachable, or a malformed connection string
        print(f"twophase: ZooKeeper at {args.zk}: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args, client, signer)
    except (CliError, SignatureError, RecordError, Fenced, KazooException) as e:
        print(f"twophase {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        client.stop()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
