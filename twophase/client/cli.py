"""The ``twophase txns`` command: list, describe and abort transactions on a Kafka-protocol broker.

    twophase txns --bootstrap-server HOST:PORT list [--state Ongoing ...]
    twophase txns --bootstrap-server HOST:PORT describe ID [ID ...]
    twophase txns --bootstrap-server HOST:PORT abort ID
    twophase txns --bootstrap-server HOST:PORT find-hanging [--topic T [--partition P] | --broker-id N]
                                                            [--max-transaction-timeout MIN]
    twophase txns --bootstrap-server HOST:PORT abort --topic T --partition P --producer-id X --producer-epoch E

``--command-config FILE`` (before the subcommand) reads TLS and SASL settings from a Kafka
``client.properties`` file (twophase.client.security), as Kafka's own tools do.

``find-hanging`` and ``abort --topic`` are KIP-664's ``kafka-transactions.sh`` commands: a hanging
transaction is open on a partition while no transaction coordinator holds it open (its
transaction log was lost, say), so only a marker written on the partition ends it.

Wiring (twophase/cli.py)::

    from twophase.client.cli import add_txns_parser
    add_txns_parser(sub)          # sets func=run_txns; needs no ZooKeeper

Exit status: 0 on success, 1 when the broker refuses or cannot be reached, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time

from twophase.cli_args import positive_seconds
from twophase.wire.errors import KafkaError

from .admin import (
    DEFAULT_MAX_TRANSACTION_TIMEOUT_MS,
    Admin,
    HangingTransaction,
    TransactionDescription,
)
from .security import load_security

_COLUMNS = ("TRANSACTIONAL ID", "STATE", "PRODUCER", "EPOCH", "AGE", "TIMEOUT", "PARTITIONS")


def _row(d: TransactionDescription) -> tuple[str, ...]:
    age = d.age_s() if d.state in ("Ongoing", "PrepareCommit", "PrepareAbort") else None
    partitions = ",".join(f"{t}-{p}" for t, p in d.partitions) or "-"
    return (d.transactional_id, d.state, str(d.producer_id), str(d.producer_epoch),
            "-" if age is None else f"{age:.0f}s", f"{d.timeout_ms / 1000:g}s", partitions)


def format_table(rows: list[tuple[str, ...]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """``rows`` under a header of ``columns``, each column padded to its widest cell."""
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [columns, *rows])


def cmd_list(admin: Admin, args) -> int:
    """``twophase txns list``: print the transactions, optionally only in the given states; returns 0."""
    listings = admin.list_transactions(states=args.state)
    descriptions = admin.describe_transactions([t.transactional_id for t in listings]) if listings else []
    print(format_table([_row(d) for d in descriptions]))
    return 0


def cmd_describe(admin: Admin, args) -> int:
    """``twophase txns describe``: print the given transactional ids; returns 0."""
    print(format_table([_row(d) for d in admin.describe_transactions(args.ids)]))
    return 0


_HANGING_COLUMNS = ("TOPIC", "PARTITION", "PRODUCER", "EPOCH", "COORDINATOR EPOCH", "START OFFSET", "IDLE")


def _hanging_row(h: HangingTransaction, now_ms: int) -> tuple[str, ...]:
    return (h.topic, str(h.partition), str(h.producer_id), str(h.producer_epoch), str(h.coordinator_epoch),
            str(h.start_offset), f"{max(0, now_ms - h.last_timestamp_ms) / 60_000:.1f}min")


def cmd_find_hanging(admin: Admin, args) -> int:
    """``twophase txns find-hanging``: print the hanging transactions of the chosen partitions; returns 0."""
    if args.partition is not None and args.topic is None:
        raise ValueError("--partition needs --topic")
    if not args.max_transaction_timeout >= 0:  # NaN too
        raise ValueError("--max-transaction-timeout must be at least 0 minutes")
    now_ms = int(time.time() * 1000)
    found = admin.find_hanging(args.topic, args.partition, args.broker,
                               max_transaction_timeout_ms=int(args.max_transaction_timeout * 60_000), now_ms=now_ms)
    print(format_table([_hanging_row(h, now_ms) for h in found], _HANGING_COLUMNS))
    return 0


def cmd_abort(admin: Admin, args) -> int:
    """``twophase txns abort``: abort a transactional id's transaction, or (``--topic``...) a hanging
    transaction on one partition; prints what it ended; returns 0."""
    by_partition = (args.topic, args.partition, args.producer_id, args.producer_epoch)
    if args.id is not None:
        if any(v is not None for v in by_partition):
            raise ValueError("give a transactional id, or --topic/--partition/--producer-id/--producer-epoch, not both")
        return _abort_transactional_id(admin, args)
    if any(v is None for v in by_partition):
        raise ValueError("give a transactional id, or all of --topic, --partition, --producer-id and --producer-epoch")
    states = admin.describe_producers([(args.topic, args.partition)])[(args.topic, args.partition)]
    state = next((s for s in states if s.producer_id == args.producer_id), None)
    start = state.txn_start_offset if state else None
    coordinator_epoch = args.coordinator_epoch
    if coordinator_epoch is None:
        coordinator_epoch = max(state.coordinator_epoch, 0) if state else 0
    admin.abort_hanging(args.topic, args.partition, args.producer_id, args.producer_epoch, coordinator_epoch)
    print(f"{args.topic}-{args.partition}: aborted the transaction of producer {args.producer_id} "
          f"epoch {args.producer_epoch} (open from offset {start})")
    return 0


def _abort_transactional_id(admin: Admin, args) -> int:
    [before] = admin.describe_transactions([args.id])
    admin.abort_transaction(args.id)
    [after] = admin.describe_transactions([args.id])
    print(f"{args.id}: was {before.state} (producer {before.producer_id} epoch {before.producer_epoch}), "
          f"now {after.state} (epoch {after.producer_epoch})")
    return 0


def run_txns(args) -> int:
    """Run the chosen ``txns`` subcommand; a KafkaError or ValueError is printed and returns 1."""
    try:
        security = load_security(f"file:{args.command_config}") if args.command_config else None
        with Admin(args.bootstrap_server, request_timeout_ms=int(args.timeout * 1000), security=security) as admin:
            return args.txns_func(admin, args)
    except (KafkaError, ValueError) as exc:
        print(f"twophase txns {args.txns_command}: {exc}", file=sys.stderr)
        return 1


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``txns`` options and its list/describe/abort subcommands to ``p``."""
    p.add_argument("--bootstrap-server", required=True, metavar="HOST:PORT",
                   help="a broker to start from (Kafka or the built-in one)")
    p.add_argument("--command-config", metavar="FILE",
                   help="client.properties with TLS/SASL settings (security.protocol, sasl.mechanism, "
                        "sasl.username, sasl.password, ssl.ca.location, ...)")
    p.add_argument("--timeout", type=positive_seconds, default=30.0, help="seconds to retry each request (default %(default)s)")
    sub = p.add_subparsers(dest="txns_command", required=True)
    q = sub.add_parser("list", help="transactions the brokers know, with state, age and partitions")
    q.add_argument("--state", action="append", metavar="STATE",
                   help="only this state (Ongoing, PrepareCommit, CompleteAbort, ...); repeatable")
    q.set_defaults(txns_func=cmd_list)
    q = sub.add_parser("describe", help="details of the given transactional ids")
    q.add_argument("ids", nargs="+", metavar="ID", help="transactional id")
    q.set_defaults(txns_func=cmd_describe)
    q = sub.add_parser("find-hanging", help="transactions open on partitions that no coordinator holds open (KIP-664)")
    where = q.add_mutually_exclusive_group()
    where.add_argument("--topic", help="only this topic's partitions")
    where.add_argument("--broker-id", "--broker", dest="broker", type=int, metavar="ID",
                       help="only partitions this broker leads")
    q.add_argument("--partition", type=int, help="only this partition (with --topic)")
    q.add_argument("--max-transaction-timeout", type=float, metavar="MIN",
                   default=DEFAULT_MAX_TRANSACTION_TIMEOUT_MS / 60_000,
                   help="only transactions idle at least this many minutes (default %(default)g, "
                        "the brokers' transaction.max.timeout.ms)")
    q.set_defaults(txns_func=cmd_find_hanging)
    q = sub.add_parser("abort", help="fence a transactional id and abort its open (or prepared) transaction, or "
                                     "abort a hanging transaction on one partition")
    q.add_argument("id", metavar="ID", nargs="?", help="transactional id")
    q.add_argument("--topic", help="the hanging transaction's topic")
    q.add_argument("--partition", type=int, help="its partition")
    q.add_argument("--producer-id", type=int, help="its producer id (find-hanging shows it)")
    q.add_argument("--producer-epoch", type=int, help="its producer epoch (find-hanging shows it)")
    q.add_argument("--coordinator-epoch", type=int,
                   help="the marker's coordinator epoch (default: the partition's, as find-hanging shows it; "
                        "the built-in broker ignores it)")
    q.set_defaults(txns_func=cmd_abort)
    p.set_defaults(func=run_txns)
    return p


def add_txns_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``txns`` command to a ``twophase`` subparsers object."""
    return configure_parser(subparsers.add_parser(
        "txns", help="list, describe or abort Kafka transactions (like kafka-transactions.sh)"))


def main(argv: list[str] | None = None) -> int:
    """Run ``twophase txns`` with ``argv``; returns the exit code."""
    args = configure_parser(argparse.ArgumentParser(prog="twophase txns")).parse_args(argv)
    return run_txns(args)


if __name__ == "__main__":
    sys.exit(main())
