"""The ``twophase txns`` command: list, describe and abort transactions on a Kafka-protocol broker.

    twophase txns --bootstrap-server HOST:PORT list [--state Ongoing ...]
    twophase txns --bootstrap-server HOST:PORT describe ID [ID ...]
    twophase txns --bootstrap-server HOST:PORT abort ID

Wiring (twophase/cli.py)::

    from twophase.client.cli import add_txns_parser
    add_txns_parser(sub)          # sets func=run_txns; needs no ZooKeeper

Exit status: 0 on success, 1 when the broker refuses or cannot be reached, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys

from twophase.wire.errors import KafkaError

from .admin import Admin, TransactionDescription

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


def cmd_abort(admin: Admin, args) -> int:
    """``twophase txns abort``: abort the id's transaction and print its state before and after; returns 0."""
    [before] = admin.describe_transactions([args.id])
    admin.abort_transaction(args.id)
    [after] = admin.describe_transactions([args.id])
    print(f"{args.id}: was {before.state} (producer {before.producer_id} epoch {before.producer_epoch}), "
          f"now {after.state} (epoch {after.producer_epoch})")
    return 0


def run_txns(args) -> int:
    """Run the chosen ``txns`` subcommand; a KafkaError or ValueError is printed and returns 1."""
    try:
        with Admin(args.bootstrap_server, request_timeout_ms=int(args.timeout * 1000)) as admin:
            return args.txns_func(admin, args)
    except (KafkaError, ValueError) as exc:
        print(f"twophase txns {args.txns_command}: {exc}", file=sys.stderr)
        return 1


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``txns`` options and its list/describe/abort subcommands to ``p``."""
    p.add_argument("--bootstrap-server", required=True, metavar="HOST:PORT",
                   help="a broker to start from (Kafka or the built-in one)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to retry each request (default %(default)s)")
    sub = p.add_subparsers(dest="txns_command", required=True)
    q = sub.add_parser("list", help="transactions the brokers know, with state, age and partitions")
    q.add_argument("--state", action="append", metavar="STATE",
                   help="only this state (Ongoing, PrepareCommit, CompleteAbort, ...); repeatable")
    q.set_defaults(txns_func=cmd_list)
    q = sub.add_parser("describe", help="details of the given transactional ids")
    q.add_argument("ids", nargs="+", metavar="ID", help="transactional id")
    q.set_defaults(txns_func=cmd_describe)
    q = sub.add_parser("abort", help="fence a transactional id and abort its open (or prepared) transaction")
    q.add_argument("id", metavar="ID", help="transactional id")
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
