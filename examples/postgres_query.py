"""A streaming query into PostgreSQL through PostgresSink: JSON files in, every row exactly once in a table.

With no arguments it runs on its own: a private ZooKeeper and a private PostgreSQL server
(``twophase.pgserver``, in temp dirs), a table ``events (id bigint, batch bigint, payload text)``,
3 micro-batches of 1,000 rows over 4 tasks with a third of first task attempts failing mid-write,
the query as a driver process of its own; then an independent reader (plain SQL over a fresh
connection) counts the rows, and the server's statistics the rows failed attempts loaded and rolled
back::

    $ python -m examples.postgres_query
    ...
    query exited 0; task attempts failed and retried: 5, their 1250 rows loaded and rolled back
    SELECT id FROM events over a fresh connection: rows in 3000, rows out 3000, lost 0, duplicated 0, unexpected 0: EXACTLY ONCE
    prepared transactions left: 0

Against a ZooKeeper and a PostgreSQL of your own (the table must exist with those columns; the
password comes from PGPASSWORD or a passfile, never from the dsn)::

    python -m examples.postgres_query --zk 127.0.0.1:2181 --dsn "host=db dbname=shop user=spark" \\
        --table events --input /tmp/in --checkpoint /tmp/ck

Each task attempt loads its rows with COPY into one database transaction and ends it with
``PREPARE TRANSACTION``; the coordinator runs ``COMMIT PREPARED`` once Spark completed the epoch. The
default is the batch path, ``write_stream(df, PostgresSink(...), app=..., zk=...)`` (an Arrow batch
at a time); ``--path foreach`` writes through ``foreach(TwoPhaseSink(PostgresSink(...)))`` instead
(a row at a time). ``--mode upsert --key id`` upserts on the table's unique key; the rows are
partitioned by the key so that one key's rows of an epoch meet in one task. It processes every
file in --input (one file per micro-batch) and exits once all of them are committed. Faults, as in
the other example queries: ``--fail-rate`` makes the first attempt of some partitions fail after
writing a batch, ``--slow-ms`` slows every row, and ``--coordinator daemon`` with no daemon running
leaves every epoch prepared (a driver killed there and restarted commits them).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from examples.file_sink_query import (
    INPUT_SCHEMA,
    build_spark,
    fails_first_attempt,
    query_parser,
    run_query,
    write_input,
)
from sinks.postgres import PostgresSink

TABLE_COLUMNS = "id bigint, batch bigint, payload text"  # INPUT_SCHEMA in PostgreSQL's types
DEMO_BATCHES, DEMO_ROWS = 3, 1000
REPO = Path(__file__).resolve().parents[1]


class FaultyPostgresSink(PostgresSink):
    """A PostgresSink whose first task attempts fail now and then, and which can be slow.

    fail_rate is the share of (run, epoch, partition) whose first attempt raises right after its
    first ``write_batch`` (or ``write``), with rows in its open database transaction; the choice is
    a hash of the Spark task (``fails_first_attempt``), the same in every worker.
    """

    def __init__(self, dsn: str, table: str, *, fail_rate: float = 0.0, slow_ms: int = 0, **options: Any) -> None:
        super().__init__(dsn, table, **options)
        self.fail_rate = fail_rate
        self.slow_ms = slow_ms

    def write(self, txn: Any, row: Any) -> None:
        """Write one row, slowly if asked; raise RuntimeError right after it in a failing attempt."""
        time.sleep(self.slow_ms / 1000)
        super().write(txn, row)
        self._maybe_fail()

    def write_batch(self, txn: Any, batch: Any) -> None:
        """Write one Arrow batch, slowly if asked; raise RuntimeError right after it in a failing attempt."""
        time.sleep(self.slow_ms / 1000 * batch.num_rows)
        super().write_batch(txn, batch)
        self._maybe_fail()

    def _maybe_fail(self) -> None:
        from twophase.spark.task_context import task_context

        if self.fail_rate and fails_first_attempt(task_context("faults"), self.fail_rate):
            raise RuntimeError("injected failure: first attempt of this partition dies mid-write")


def create_table(dsn: str, table: str, key: list[str] | None = None) -> None:
    """Create ``table`` with the query's columns, with a primary key on ``key`` if given (upsert)."""
    primary = sql.SQL(", PRIMARY KEY ({})").format(sql.SQL(", ").join(map(sql.Identifier, key))) if key else sql.SQL("")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}{})").format(
            sql.Identifier(table), sql.SQL(TABLE_COLUMNS), primary))


def read_ids(dsn: str, table: str) -> list[int]:
    """Every id in ``table``, duplicates included: an independent reader (a fresh connection, plain SQL)."""
    with psycopg.connect(dsn) as conn:
        return [i for (i,) in conn.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table)))]


def prepared_left(dsn: str) -> list[str]:
    """The global ids of the prepared transactions left in ``dsn``'s database: none once all is committed."""
    with psycopg.connect(dsn) as conn:
        return [gid for (gid,) in conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() ORDER BY gid")]


def loaded_rows(dsn: str, table: str) -> int:
    """Rows ever inserted into ``table``, those of rolled-back attempts included: the server's statistics
    (``n_tup_ins``), which each connection reports when it closes."""
    with psycopg.connect(dsn) as conn:
        (n,) = conn.execute("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables WHERE relname = %s",
                            (table,)).fetchone()
        return n


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The example queries' options (``query_parser``) and where the rows go."""
    parser = query_parser(__doc__.splitlines()[0], app="postgres-example")
    parser.add_argument("--dsn", required=True, help="libpq conninfo, without a password")
    parser.add_argument("--table", required=True)
    parser.add_argument("--mode", choices=("append", "upsert"), default="append")
    parser.add_argument("--key", type=lambda s: s.split(","), help="upsert's key columns, comma-separated")
    parser.add_argument("--path", choices=("batch", "foreach"), default="batch",
                        help="write_stream (Arrow batches, the default) or foreach(TwoPhaseSink(...)) (rows)")
    return parser.parse_args(argv)


def make_sink(args: argparse.Namespace) -> FaultyPostgresSink:
    """The query's sink from its arguments."""
    return FaultyPostgresSink(args.dsn, args.table, mode=args.mode, key=args.key,
                              fail_rate=args.fail_rate, slow_ms=args.slow_ms)


def start_query(spark, sink: PostgresSink, args: argparse.Namespace):
    """The batch path: every input file is one micro-batch over ``args.partitions`` tasks, by key for upsert."""
    from twophase.spark import write_stream

    df = spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).json(args.input)
    df = df.repartition(args.partitions, *(args.key or []))
    return (write_stream(df, sink, app=args.app, zk=args.zk, root=args.root, coordinator=args.coordinator)
            .option("checkpointLocation", args.checkpoint)
            .trigger(availableNow=True)
            .start())


def run(args: argparse.Namespace) -> int:
    """Stream args.input into args.table until the input is used up and (embedded coordinator) committed."""
    if args.path == "foreach":
        return run_query(make_sink(args), args)
    from twophase.spark import await_committed

    spark = build_spark()
    query = start_query(spark, make_sink(args), args)
    query.awaitTermination()
    if args.coordinator == "embedded":
        await_committed(query, timeout=120)
    spark.stop()
    return 0


def demo() -> int:
    """Everything private and temporary: ZooKeeper, PostgreSQL, input, checkpoint; the query runs as a
    driver process of its own (its Spark log, failed attempts included, goes to a file). 0 if exactly once."""
    from examples.demo_processes import kill_group, spawn
    from twophase.pgserver import PostgresServer
    from twophase.verify import count_rows
    from twophase.zkserver import ZooKeeperServer

    # Signs what the coordinator stores in ZooKeeper; the driver and Spark's workers inherit it.
    os.environ.setdefault("TWOPHASE_SECRET", secrets.token_hex(32))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory(prefix="twophase-pg-example-") as work, \
            ZooKeeperServer() as zk, PostgresServer() as pg:
        dsn = pg.create_database("example")
        create_table(dsn, "events")
        for b in range(DEMO_BATCHES):
            write_input(f"{work}/in", b, range(b * DEMO_ROWS, (b + 1) * DEMO_ROWS))
        print(f"ZooKeeper {zk.hosts}, PostgreSQL {pg.host}:{pg.port}: {DEMO_BATCHES} batches x {DEMO_ROWS} rows "
              "into table events over 4 tasks, a third of first task attempts failing mid-write", flush=True)
        driver = spawn([sys.executable, "-m", "examples.postgres_query", "--zk", zk.hosts, "--dsn", dsn,
                        "--table", "events", "--input", f"{work}/in", "--checkpoint", f"{work}/ck",
                        "--fail-rate", "0.33"], f"{work}/driver.log")
        try:
            rc = driver.wait()
        finally:
            kill_group(driver)
        log = Path(f"{work}/driver.log").read_text(errors="replace")
        report = count_rows(range(DEMO_BATCHES * DEMO_ROWS), read_ids(dsn, "events"))
        left = prepared_left(dsn)
        loaded = loaded_rows(dsn, "events")
    if rc != 0:
        print("the query failed; the end of its log:", *log.splitlines()[-40:], sep="\n")
    print(f"query exited {rc}; task attempts failed and retried: {log.count('ERROR Executor: Exception in task')}, "
          f"their {loaded - report.rows_out} rows loaded and rolled back")
    print(f"SELECT id FROM events over a fresh connection: {report}")
    print(f"prepared transactions left: {len(left)}")
    return 0 if rc == 0 and report.exact and not left else 1


def main(argv: list[str] | None = None) -> int:
    """Run the example query (or, without arguments, the self-contained demo); return its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    return run(parse_args(argv)) if argv else demo()


if __name__ == "__main__":
    sys.exit(main())
