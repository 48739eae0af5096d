"""The `twophase` command: status, recovery and the HA coordinator daemon.

    twophase status --zk HOSTS --app NAME [--root /twophase]
    twophase recover --zk HOSTS --app NAME [--checkpoint DIR] [--dry-run] [--retry-failed]
    twophase coordinator --zk HOSTS [--root /twophase]
    twophase broker --data-dir DIR [--port 9092]
    twophase txns --bootstrap-server HOST:PORT list|describe|abort
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from kazoo.exceptions import KazooException, NoNodeError

from coordinator.app import AppCoordinator, CommitPolicy, PassOptions
from coordinator.daemon import CoordinatorDaemon
from coordinator.layout import DEFAULT_ROOT, AppPaths, QueryPaths
from coordinator.precommits import PrecommitRegistry
from coordinator.state import EpochRecord
from coordinator.zk import connect, read_json
from twophase.broker.cli import add_broker_parser
from twophase.client.cli import add_txns_parser
from twophase.signing import SignatureError, Signer, load_secret


class CliError(Exception):
    """A failure the user can act on; printed without a traceback."""


def _age(seconds_since_epoch: float) -> str:
    return f"{max(0.0, time.time() - seconds_since_epoch):.0f}s"


def _children(client, path: str) -> list[str]:
    try:
        return sorted(client.get_children(path))
    except NoNodeError:
        return []


def _checkpoint_query_id(checkpoint: str) -> str:
    try:
        with open(os.path.join(checkpoint, "metadata")) as f:
            return json.loads(f.readline())["id"]
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"{checkpoint} is not a Spark streaming checkpoint: {e}") from e


def cmd_status(args, client, signer: Signer) -> int:
    paths = AppPaths(args.root, args.app)
    if not client.exists(paths.base):
        raise CliError(f"no app {args.app!r} under {args.root}")
    config = read_json(client, paths.base, {})
    owner, _ = client.get(paths.fence) if client.exists(paths.fence) else (b"-", None)
    print(f"app {args.app}  coordinator: {config.get('coordinator', '?')}  owner: {owner.decode() or '-'}")
    for qid in _children(client, paths.queries):
        qp = paths.query(qid)
        info = read_json(client, qp.base, {})
        watermark = read_json(client, qp.watermark, {"epoch": -1})["epoch"]
        barrier = read_json(client, qp.barrier, {"epoch": -1})
        print(f"  query {qid}\n    checkpoint: {info.get('checkpoint', 'unknown')}")
        print(f"    committed watermark: {watermark}   spark barrier: {barrier['epoch']}")
        for run in _children(client, qp.runs):
            started = read_json(client, qp.run(run), {}).get("started", time.time())
            alive = "alive" if client.exists(f"{qp.run(run)}/alive") else "ended"
            print(f"    run {run}  {alive}  started {_age(started)} ago")
        _print_epochs(client, qp, signer, watermark)
    return 0


def _print_epochs(client, qp: QueryPaths, signer: Signer, watermark: int) -> None:
    registry = PrecommitRegistry(client, qp, signer)
    for name in _children(client, qp.epochs):
        epoch = int(name)
        record = EpochRecord.decode(client.get(qp.epoch(epoch))[0])
        attempts = registry.load(epoch)
        if epoch <= watermark and not attempts:
            continue  # committed and settled: not worth a line
        print(f"    epoch {epoch}: {record.state.value}" + (f"  error: {record.error}" if record.error else ""))
        for a in attempts:
            role = "winner" if a.won else "loser"
            doubt = "in-doubt" if record.state.value != "open" else "pending"
            print(f"      {a.name}  partition {a.partition} attempt {a.attempt}  {role}  {doubt}  "
                  f"age {_age(a.registered)}")
        for failed in _children(client, qp.failures(epoch)):
            f = read_json(client, f"{qp.failures(epoch)}/{failed}", {})
            print(f"      FAILURE {failed}: {f.get('operation')} x{f.get('count')}: {f.get('error')}")


def cmd_recover(args, client, signer: Signer) -> int:
    paths = AppPaths(args.root, args.app)
    if not client.exists(paths.base):
        raise CliError(f"no app {args.app!r} under {args.root}")
    queries = _children(client, paths.queries)
    if args.checkpoint:
        qid = _checkpoint_query_id(args.checkpoint)
        if qid not in queries:
            raise CliError(f"checkpoint {args.checkpoint} belongs to query {qid}, which has no state in app {args.app}")
    live = [f"{q}/{r}" for q in queries for r in _children(client, paths.query(q).runs)
            if client.exists(f"{paths.query(q).run(r)}/alive")]
    if live and not args.force:
        raise CliError(f"runs still alive ({', '.join(live)}); recover while no query runs, or pass --force")
    options = PassOptions(recovering=True, dry_run=args.dry_run, abort_incomplete=True,
                          retry_failed=args.retry_failed, checkpoint=args.checkpoint)
    app = AppCoordinator(client, args.root, args.app, signer, f"recover {socket.gethostname()}:{os.getpid()}",
                         CommitPolicy(attempts=args.attempts))
    if not args.dry_run:
        app.acquire()
    actions = app.reconcile(options)
    for line in actions or ["nothing to do"]:
        print(("[dry-run] " if args.dry_run else "") + line)
    return 1 if any("FAILED" in line for line in actions) else 0


def cmd_coordinator(args, client, signer: Signer) -> int:
    client.stop()  # the daemon manages its own session
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    CoordinatorDaemon(args.zk, args.root, signer, CommitPolicy(poll_interval=args.poll_interval),
                      session_timeout=args.session_timeout).run(stop)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twophase", description="Exactly-once 2PC sinks for Spark: operations.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser, app: bool = True) -> None:
        p.add_argument("--zk", required=True, help="ZooKeeper connection string, e.g. 127.0.0.1:2181")
        p.add_argument("--root", default=DEFAULT_ROOT, help="root znode of twophase state (default %(default)s)")
        p.add_argument("--secret-file", help="file holding the HMAC secret (default: $TWOPHASE_SECRET, "
                                             "$TWOPHASE_SECRET_FILE or ~/.config/twophase/secret)")
        if app:
            p.add_argument("--app", required=True, help="the app name given to TwoPhaseSink")

    p = sub.add_parser("status", help="show runs, epochs, pending and in-doubt transactions, the watermark")
    common(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("recover", help="commit pre-commits of completed epochs, abort the rest")
    common(p)
    p.add_argument("--checkpoint", help="the query's Spark checkpoint directory (default: the recorded one)")
    p.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    p.add_argument("--retry-failed", action="store_true", help="retry epochs marked FAILED")
    p.add_argument("--force", action="store_true", help="run even though a query run looks alive")
    p.add_argument("--attempts", type=int, default=3, help="tries per commit or abort (default %(default)s)")
    p.set_defaults(func=cmd_recover)

    p = sub.add_parser("coordinator", help="run an HA coordinator daemon (leader election among daemons)")
    common(p, app=False)
    p.add_argument("--poll-interval", type=float, default=2.0, help="seconds between checkpoint scans")
    p.add_argument("--session-timeout", type=float, default=10.0,
                   help="ZooKeeper session timeout: how fast a standby takes over a dead leader")
    p.set_defaults(func=cmd_coordinator)

    add_broker_parser(sub).set_defaults(needs_zookeeper=False)
    add_txns_parser(sub).set_defaults(needs_zookeeper=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    daemon = args.command in ("coordinator", "broker")
    logging.basicConfig(level=logging.INFO if args.verbose or daemon else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "needs_zookeeper", True):
        return args.func(args)
    try:
        secret = open(args.secret_file).read().strip() if args.secret_file else None
        signer = Signer(load_secret(secret))
        client = connect(args.zk, timeout=10)
    except Exception as e:
        print(f"twophase: {e}", file=sys.stderr)
        return 2
    try:
        return args.func(args, client, signer)
    except (CliError, SignatureError, KazooException, ValueError) as e:
        print(f"twophase {args.command}: {e}", file=sys.stderr)
        return 2
    finally:
        client.stop()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
