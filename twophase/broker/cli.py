"""The ``twophase broker`` command: run the built-in broker until SIGTERM or SIGINT.

    twophase broker --data-dir DIR [--host 127.0.0.1] [--port 9092] [--default-partitions N]
                    [--fsync always|<ms>] [--no-auto-create-topics] [--advertised-host HOST]
                    [--no-two-phase-commit] [--transaction-max-timeout-ms MS]
                    [--transactional-id-expiration-ms MS] [--connections-max-idle-ms MS]
                    [--queued-max-request-bytes N] [--group-initial-rebalance-delay-ms MS]
                    [--request-receive-timeout-ms MS] [--fetch-max-bytes N] [--fetch-bytes-in-flight N]
                    [--max-partitions N]

Wiring (twophase/cli.py)::

    from twophase.broker.cli import add_broker_parser
    add_broker_parser(sub)           # sets func=run_broker; run_broker(args) needs no ZooKeeper

Also runnable alone: ``python -m twophase.broker.cli --data-dir DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from twophase.cli_args import int_from as _int_from
from twophase.cli_args import non_empty
from twophase.wire.errors import KafkaError

from .broker import DEFAULT_FETCH_MAX_BYTES, MIN_MAX_REQUEST_BYTES, Broker, BrokerConfig
from .server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RECEIVE_TIMEOUT_MS
from .storage import DataDirLockedError
from .txn.log import TransactionLogCorrupt

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
                        group_initial_rebalance_delay_ms=args.group_initial_rebalance_delay_ms)


async def _serve(args) -> None:
    broker = Broker(args.data_dir, config=_config(args))
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
        asyncio.run(_serve(args))
    # Port or data directory in use, bad settings, a damaged transaction log, storage failing at recovery.
    except (OSError, DataDirLockedError, ValueError, TransactionLogCorrupt, KafkaError) as exc:
        print(f"twophase broker: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``twophase broker`` with ``argv``; returns the exit code."""
    parser = configure_parser(argparse.ArgumentParser(prog="twophase broker", description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
