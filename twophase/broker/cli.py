"""The ``twophase broker`` command: run the built-in broker until SIGTERM or SIGINT.

    twophase broker --data-dir DIR [--host 127.0.0.1] [--port 9092] [--default-partitions N]
                    [--fsync always|<ms>] [--no-auto-create-topics] [--advertised-host HOST]
                    [--no-two-phase-commit] [--transaction-max-timeout-ms MS]
                    [--transactional-id-expiration-ms MS] [--connections-max-idle-ms MS]
                    [--queued-max-request-bytes N] [--group-initial-rebalance-delay-ms MS]
                    [--request-receive-timeout-ms MS] [--fetch-max-bytes N] [--fetch-bytes-in-flight N]
                    [--max-partitions N]
                    [--security-protocol PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL]
                    [--ssl-certificate PEM --ssl-key PEM] [--sasl-mechanisms M[,M...]] [--users-file FILE]

    twophase broker-users add --users-file FILE NAME [--iterations N]   # password from stdin or a prompt
    twophase broker-users remove --users-file FILE NAME
    twophase broker-users list --users-file FILE

The key's password, if it has one, comes from $TWOPHASE_SSL_KEY_PASSWORD (never from argv, where
``ps`` shows it).

Wiring (twophase/cli.py)::

    from twophase.broker.cli import add_broker_parser, add_users_parser
    add_broker_parser(sub)           # sets func=run_broker; run_broker(args) needs no ZooKeeper
    add_users_parser(sub)            # sets func=run_users

Also runnable alone: ``python -m twophase.broker.cli --data-dir DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import os
import signal
import sys

from twophase.cli_args import int_from as _int_from
from twophase.cli_args import non_empty
from twophase.wire.errors import KafkaError
from twophase.wire.security import SASL_MECHANISMS, SECURITY_PROTOCOLS, sasl_mechanism, security_protocol

from .broker import DEFAULT_FETCH_MAX_BYTES, MIN_MAX_REQUEST_BYTES, Broker, BrokerConfig
from .server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RECEIVE_TIMEOUT_MS
from .storage import DataDirLockedError
from .txn.log import TransactionLogCorrupt
from .users import MAX_ITERATIONS, MIN_ITERATIONS, add_user, read_users, remove_user

log = logging.getLogger("twophase.broker")


def _fsync(value: str) -> str | int:
    if value == "always":
        return value
    try:
        ms = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fsync takes 'always' or a number of milliseconds, not {value!r}")
    if ms < 0:
        raise argparse.ArgumentTypeError("--fsync interval must be >= 0 ms")
    return ms


_positive = _int_from(1)
SSL_KEY_PASSWORD_ENV = "TWOPHASE_SSL_KEY_PASSWORD"


def _argparse_type(parse, name: str):
    """``parse`` as an argparse type: its ValueError becomes the option's error message."""
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = name
    return convert


def _mechanisms(value: str) -> tuple[str, ...]:
    return tuple(sasl_mechanism(m, "--sasl-mechanisms") for m in value.split(","))
_directory = non_empty("a directory")


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the broker's options to ``p``; its ``func`` default runs the broker."""
    p.add_argument("--data-dir", type=_directory, required=True, help="directory of the logs and broker state")
    p.add_argument("--host", type=non_empty("an address (0.0.0.0 for every interface)"),
                   default="127.0.0.1", help="address to listen on, 0.0.0.0 for all (default %(default)s)")
    p.add_argument("--port", type=_int_from(0, 65535), default=9092, help="port to listen on, 0 for any (default %(default)s)")
    p.add_argument("--advertised-host", type=non_empty("a host name"),
                   help="host name given to clients in Metadata (default: --host)")
    p.add_argument("--default-partitions", type=_positive, default=1,
                   help="partitions of auto-created topics and of CreateTopics with -1 (default %(default)s)")
    p.add_argument("--no-auto-create-topics", dest="auto_create_topics", action="store_false",
                   help="do not create unknown topics on Metadata or Produce")
    p.add_argument("--fsync", type=_fsync, default="always",
                   help="'always' (fsync every append) or the maximum milliseconds between fsyncs "
                        "(default %(default)s)")
    p.add_argument("--max-request-bytes", type=_int_from(MIN_MAX_REQUEST_BYTES), default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request accepted, at least %d (64 KiB); larger ones close the connection "
                        "(default %%(default)s)" % MIN_MAX_REQUEST_BYTES)
    p.add_argument("--no-two-phase-commit", dest="two_phase_commit", action="store_false",
                   help="refuse KIP-939 prepared transactions (InitProducerId with enable2Pc): like Kafka's "
                        "transaction.two.phase.commit.enable=false")
    p.add_argument("--transaction-max-timeout-ms", type=_positive, default=900_000,
                   help="largest transaction timeout a producer may ask for (default %(default)s)")
    p.add_argument("--transactional-id-expiration-ms", type=_positive, default=7 * 24 * 3600 * 1000,
                   help="forget transactional ids idle this long (default %(default)s, 7 days)")
    p.add_argument("--connections-max-idle-ms", type=_positive, default=600_000,
                   help="close connections without a request for this long (default %(default)s)")
    p.add_argument("--queued-max-request-bytes", type=_positive, default=200 * 1024 * 1024,
                   help="request bytes buffered across all connections before reading pauses "
                        "(default %(default)s)")
    p.add_argument("--max-partitions", type=_positive, default=10_000,
                   help="most partitions of all topics together; creating more is refused (default %(default)s)")
    p.add_argument("--fetch-max-bytes", type=_positive, default=DEFAULT_FETCH_MAX_BYTES,
                   help="most record bytes one Fetch response holds, beyond its first batch (default %(default)s)")
    p.add_argument("--fetch-bytes-in-flight", type=_positive, default=4 * DEFAULT_FETCH_MAX_BYTES,
                   help="record bytes of Fetch responses read or sent at once across all connections "
                        "(default %(default)s)")
    p.add_argument("--request-receive-timeout-ms", type=_positive, default=DEFAULT_RECEIVE_TIMEOUT_MS,
                   help="close a connection whose request's next 1 MiB has not arrived this long after its size "
                        "or the previous MiB, "
                        "or that leaves a response unread this long (default %(default)s)")
    p.add_argument("--group-initial-rebalance-delay-ms", type=_int_from(0), default=3_000,
                   help="how long a new consumer group waits for more members before its first "
                        "rebalance (default %(default)s)")
    p.add_argument("--security-protocol", type=_argparse_type(security_protocol, "security protocol"),
                   default="PLAINTEXT", metavar="|".join(SECURITY_PROTOCOLS),
                   help="the listener's security, as Kafka names it (default %(default)s)")
    p.add_argument("--ssl-certificate", metavar="PEM", help="the broker's certificate (chain), for SSL and SASL_SSL")
    p.add_argument("--ssl-key", metavar="PEM", help="its private key (default: in --ssl-certificate's file); "
                                                   f"its password, if any, from ${SSL_KEY_PASSWORD_ENV}")
    p.add_argument("--sasl-mechanisms", type=_argparse_type(_mechanisms, "mechanisms"), default=SASL_MECHANISMS,
                   metavar="M[,M...]", help=f"SASL mechanisms enabled (default {','.join(SASL_MECHANISMS)})")
    p.add_argument("--users-file", metavar="FILE",
                   help="the SASL users and their SCRAM credentials (twophase broker-users add makes it)")
    p.set_defaults(func=run_broker)
    return p


def add_broker_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``broker`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser("broker", help="run the built-in Kafka-protocol log broker",
                              description="Run the built-in log broker (Kafka wire protocol) until "
                                          "SIGTERM or SIGINT.")
    return configure_parser(p)


def _config(args) -> BrokerConfig:
    return BrokerConfig(host=args.host, port=args.port, advertised_host=args.advertised_host,
                        default_partitions=args.default_partitions, auto_create_topics=args.auto_create_topics,
                        fsync=args.fsync, max_request_bytes=args.max_request_bytes,
                        transaction_two_phase_commit=args.two_phase_commit,
                        transaction_max_timeout_ms=args.transaction_max_timeout_ms,
                        transactional_id_expiration_ms=args.transactional_id_expiration_ms,
                        connections_max_idle_ms=args.connections_max_idle_ms,
                        queued_max_request_bytes=args.queued_max_request_bytes,
                        request_receive_timeout_ms=args.request_receive_timeout_ms,
                        fetch_max_bytes=args.fetch_max_bytes, fetch_bytes_in_flight=args.fetch_bytes_in_flight,
                        max_partitions=args.max_partitions,
                        group_initial_rebalance_delay_ms=args.group_initial_rebalance_delay_ms,
                        security_protocol=args.security_protocol, ssl_certificate=args.ssl_certificate,
                        ssl_key=args.ssl_key, ssl_key_password=os.environ.get(SSL_KEY_PASSWORD_ENV) or None,
                        sasl_mechanisms=args.sasl_mechanisms, users_file=args.users_file)


async def _serve(args, config: BrokerConfig) -> None:
    broker = Broker(args.data_dir, config=config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("%s: shutting down", signal.Signals(s).name),
                                                    stop.set()))
    await broker.start_async()
    print(f"twophase broker listening on {broker.bootstrap}", flush=True)
    try:
        await stop.wait()
    finally:
        await broker.stop_async()


def run_broker(args, *_ignored) -> int:
    """Run until SIGTERM/SIGINT; 0 after a clean shutdown, 2 if the broker cannot start."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("twophase.broker").setLevel(logging.INFO)
    try:
        config = _config(args)  # bad combinations of settings are refused before anything starts
        asyncio.run(_serve(args, config))
    # Port or data directory in use, bad settings, a damaged transaction log, storage failing at recovery.
    except (OSError, DataDirLockedError, ValueError, TransactionLogCorrupt, KafkaError) as exc:
        print(f"twophase broker: {exc}", file=sys.stderr)
        return 2
    return 0


def _read_password(name: str) -> str:
    """The new password: asked twice at a terminal, else the first line of stdin (never from argv)."""
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {name}: ")
        if getpass.getpass("again: ") != password:
            raise ValueError("the two passwords differ")
        return password
    return sys.stdin.readline().rstrip("\r\n")


def cmd_users_add(args) -> int:
    """``twophase broker-users add``: add a user or give it a new password; prints which."""
    new = add_user(args.users_file, args.name, _read_password(args.name), args.iterations)
    print(f"{args.users_file}: {'added' if new else 'updated'} user {args.name} (SCRAM-SHA-256, SCRAM-SHA-512, "
          f"{args.iterations} iterations)")
    return 0


def cmd_users_remove(args) -> int:
    """``twophase broker-users remove``: remove a user."""
    remove_user(args.users_file, args.name)
    print(f"{args.users_file}: removed user {args.name}")
    return 0


def cmd_users_list(args) -> int:
    """``twophase broker-users list``: the users and their mechanisms, one a line."""
    for name, credentials in sorted(read_users(args.users_file).items()):
        print(name, " ".join(f"{m}({c.iterations})" for m, c in sorted(credentials.items())))
    return 0


def run_users(args, *_ignored) -> int:
    """Run the chosen ``broker-users`` subcommand; a bad file, name or password is printed and returns 2."""
    try:
        return args.users_func(args)
    except (ValueError, OSError) as exc:
        print(f"twophase broker-users {args.users_command}: {exc}", file=sys.stderr)
        return 2


def configure_users_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``broker-users`` subcommands to ``p``."""
    sub = p.add_subparsers(dest="users_command", required=True)
    q = sub.add_parser("add", help="add a user, or give one a new password (read from stdin or asked for)")
    q.add_argument("name", metavar="NAME")
    q.add_argument("--iterations", type=_int_from(MIN_ITERATIONS, MAX_ITERATIONS), default=MIN_ITERATIONS,
                   help="SCRAM iterations (default %(default)s, Kafka's minimum)")
    q.set_defaults(users_func=cmd_users_add)
    q = sub.add_parser("remove", help="remove a user")
    q.add_argument("name", metavar="NAME")
    q.set_defaults(users_func=cmd_users_remove)
    q = sub.add_parser("list", help="the users and their SCRAM mechanisms")
    q.set_defaults(users_func=cmd_users_list)
    for q in sub.choices.values():
        q.add_argument("--users-file", required=True, metavar="FILE", help="the broker's users file")
    p.set_defaults(func=run_users)
    return p


def add_users_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``broker-users`` command to a ``twophase`` subparsers object; returns its parser."""
    return configure_users_parser(subparsers.add_parser(
        "broker-users", help="manage the built-in broker's SASL users (SCRAM credentials, never passwords)"))


def main(argv: list[str] | None = None) -> int:
    """Run ``twophase broker`` with ``argv``; returns the exit code."""
    parser = configure_parser(argparse.ArgumentParser(prog="twophase broker", description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
