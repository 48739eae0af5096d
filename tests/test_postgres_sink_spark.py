"""PostgresSink in real local Spark, against a real ZooKeeper and a real PostgreSQL (twophase.pgserver).

The queries are examples/postgres_query.py's: JSON files in, one per micro-batch, into a table
``events (id, batch, payload)``. In-process cases use the session's SparkSession; the chaos cases run
the example as a driver process of its own and SIGKILL it (tests/test_chaos_driver.py's helpers) or
kill -9 PostgreSQL under it. After each, an independent reader (``SELECT id`` over a fresh
connection) counts every row: nothing lost, nothing twice, and no prepared transaction left behind.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from examples import file_sink_query
from examples.file_sink_query import write_input
from examples.postgres_query import (
    create_table,
    loaded_rows,
    make_sink,
    parse_args,
    prepared_left,
    read_ids,
    start_query,
)
from sinks.postgres import PostgresSink
from tests.test_chaos_driver import (
    APP,
    JOB_TIMEOUT,
    ROWS_PER_BATCH,
    SLOW_MS,
    Job,
    assert_all_committed,
    kill_mid_batch,
    kill_run,
    spark_completed,
    wait_exit,
    wait_while_alive,
    watermark,
)
from tests.waiting import wait_until
from twophase.pgserver import PostgresServer
from twophase.spark import TwoPhaseSink, await_committed, write_stream
from twophase.verify import count_rows

pytestmark = pytest.mark.spark

MODULE = "examples.postgres_query"
TABLE = "events"
BATCHES, ROWS = 3, 40  # in-process queries: 3 micro-batches of 40 rows over 4 tasks


def query_args(zk_server, zk_root: str, dsn: str, tmp_path, *flags: str):
    """The example's arguments for an in-process query on the test's ZooKeeper root and database."""
    return parse_args(["--zk", zk_server.hosts, "--root", zk_root, "--dsn", dsn, "--table", TABLE,
                       "--input", str(tmp_path / "in"), "--checkpoint", str(tmp_path / "ck"), *flags])


def write_batches(tmp_path, ranges: list[range]) -> None:
    for b, ids in enumerate(ranges):
        write_input(str(tmp_path / "in"), b, ids)


def assert_exactly_once(dsn: str, expected: range, logs: str = "") -> None:
    report = count_rows(expected, read_ids(dsn, TABLE))
    assert report.exact, f"{report}\n{logs}"
    assert prepared_left(dsn) == [], f"prepared transactions left behind\n{logs}"


# -- in-process queries (the session's SparkSession) ---------------------------------------------------


def test_batch_path_exactly_once_while_half_the_first_attempts_fail(spark, zk_server, zk_root, pg_dsn, tmp_path):
    create_table(pg_dsn, TABLE)
    write_batches(tmp_path, [range(b * ROWS, (b + 1) * ROWS) for b in range(BATCHES)])
    args = query_args(zk_server, zk_root, pg_dsn, tmp_path, "--fail-rate", "0.5")
    query = start_query(spark, make_sink(args), args)
    query.awaitTermination()
    assert await_committed(query, timeout=120) == BATCHES - 1
    assert_exactly_once(pg_dsn, range(BATCHES * ROWS))
    # The failed attempts had loaded their rows before they died: those were rolled back, not skipped.
    wait_until(lambda: loaded_rows(pg_dsn, TABLE) > BATCHES * ROWS, what="the server to count the rolled-back rows")


def test_foreach_path_exactly_once_while_half_the_first_attempts_fail(spark, zk_server, zk_root, pg_dsn, tmp_path):
    create_table(pg_dsn, TABLE)
    write_batches(tmp_path, [range(b * ROWS, (b + 1) * ROWS) for b in range(BATCHES)])
    args = query_args(zk_server, zk_root, pg_dsn, tmp_path, "--fail-rate", "0.5", "--path", "foreach")
    with TwoPhaseSink(make_sink(args), app=args.app, zk=args.zk, root=args.root) as writer:
        query = file_sink_query.start_query(spark, writer, args.input, args.checkpoint)
        query.awaitTermination()
        assert writer.await_committed(query, timeout=120) == BATCHES - 1
    assert_exactly_once(pg_dsn, range(BATCHES * ROWS))


def test_upsert_keeps_each_keys_last_value_across_epochs(spark, zk_server, zk_root, pg_dsn, tmp_path):
    """Batch b writes ids b*20 .. b*20+39: each id comes again in the next batch, with a later batch
    number, while first attempts fail. The table ends with one row per id, from its last batch."""
    batches = 4
    create_table(pg_dsn, TABLE, key=["id"])
    write_batches(tmp_path, [range(b * 20, b * 20 + 40) for b in range(batches)])
    args = query_args(zk_server, zk_root, pg_dsn, tmp_path, "--mode", "upsert", "--key", "id", "--fail-rate", "0.5")
    query = start_query(spark, make_sink(args), args)
    query.awaitTermination()
    assert await_committed(query, timeout=120) == batches - 1
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(f"SELECT id, batch, payload FROM {TABLE} ORDER BY id").fetchall()
    last = batches - 1
    assert rows == [(i, min(i // 20, last), f"row-{i}") for i in range(last * 20 + 40)]
    assert prepared_left(pg_dsn) == []


@pytest.mark.parametrize("path, table_sql, message", [
    ("batch", None, 'table="events": no such table'),
    ("batch", "id bigint, batch bigint", "has no column 'payload'"),
    ("batch", "id boolean, batch bigint, payload text", "column 'id' of .* is boolean; the query's int64"),
    # foreach knows no schema before the first row: the table and the sink's columns are checked
    ("foreach", None, 'table="events": no such table'),
    ("foreach", "id bigint, batch bigint", "has no column 'payload'"),
])
def test_wrong_table_fails_before_any_row(spark, zk_server, zk_root, pg_dsn, tmp_path, path, table_sql, message):
    """A missing table, a missing column, a column of another type: the query fails when it is set up,
    with a message naming what is wrong, and nothing reaches the database."""
    if table_sql is not None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {TABLE} ({table_sql})")
    write_batches(tmp_path, [range(ROWS)])
    args = query_args(zk_server, zk_root, pg_dsn, tmp_path)
    sink = PostgresSink(pg_dsn, TABLE, columns=["id", "batch", "payload"] if path == "foreach" else None)
    with pytest.raises(ValueError, match=message):
        if path == "batch":
            start_query(spark, sink, args)
        else:
            TwoPhaseSink(sink, app=args.app, zk=args.zk, root=args.root)
    assert spark.streams.active == []
    if table_sql is not None:
        assert read_ids(pg_dsn, TABLE) == []
    assert prepared_left(pg_dsn) == []


def test_server_without_prepared_transactions_fails_before_any_row(spark, zk_server, zk_root, tmp_path):
    with PostgresServer(max_prepared_transactions=0) as server:
        dsn = server.create_database("noprepare")
        create_table(dsn, TABLE)
        df = spark.readStream.schema(file_sink_query.INPUT_SCHEMA).json(str(tmp_path))
        with pytest.raises(ValueError, match="max_prepared_transactions"):
            write_stream(df, PostgresSink(dsn, TABLE), app="noprepare", zk=zk_server.hosts, root=zk_root)
        assert read_ids(dsn, TABLE) == []


# -- chaos: the example as a driver process of its own --------------------------------------------------


@dataclass
class PgJob(Job):
    """The chaos Job, with examples/postgres_query.py writing into ``dsn``'s table ``events``."""

    dsn: str = ""

    def command(self, module: str, flags: tuple[str, ...]) -> list[str]:
        # Every run is the PostgreSQL example, whichever module the shared helpers name.
        return [sys.executable, "-m", MODULE, "--zk", self.zk_hosts, "--root", self.root, "--app", APP,
                "--dsn", self.dsn, "--table", TABLE, "--input", str(self.input),
                "--checkpoint", str(self.checkpoint), *flags]

    def check(self) -> None:
        """Every input row exactly once, every epoch committed, nothing left prepared."""
        assert_exactly_once(self.dsn, self.expected, self.logs())


def make_job(zk_server, zk_root: str, tmp_path, dsn: str) -> PgJob:
    create_table(dsn, TABLE)
    job = PgJob(zk_server.hosts, zk_root, tmp_path, batches=5, dsn=dsn)
    job.write_input()
    return job


@pytest.fixture
def job(zk_server, zk_root, tmp_path, pg_dsn) -> Iterator[PgJob]:
    made = make_job(zk_server, zk_root, tmp_path, pg_dsn)
    yield made
    for run in made.runs:  # a failed test must not leave a driver behind
        if run.proc.poll() is None:
            kill_run(run)


def run_to_end(zk, job: PgJob, *flags: str) -> None:
    job.run_to_end(*flags)
    assert_all_committed(zk, job)
    job.check()


@pytest.mark.chaos
def test_driver_killed_between_pre_commit_and_commit_commits_after_restart(zk, job):
    """commits/0 is written and nobody committed epoch 0 (daemon mode, no daemon) when the driver is
    SIGKILLed: its transactions stay prepared and invisible until the restarted driver commits them."""
    run = job.start("--coordinator", "daemon", "--slow-ms", str(SLOW_MS))
    wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
    kill_run(run)
    assert watermark(zk, job) < 0, "epoch 0 committed although no coordinator ran"
    assert len(prepared_left(job.dsn)) >= 4, "epoch 0's four partitions are not prepared"
    assert read_ids(job.dsn, TABLE) == [], "prepared rows are visible before the commit"

    run_to_end(zk, job, "--fail-rate", "0.3")


@pytest.mark.chaos
def test_driver_killed_mid_batch_restarts_with_fewer_partitions(zk, job):
    """Killed while an epoch is partly prepared with 4 partitions, restarted with 2: the killed run's
    prepared transactions (registered or not) are rolled back, the re-run epoch commits once."""
    run = job.start("--partitions", "4", "--slow-ms", str(SLOW_MS), "--fail-rate", "0.3")
    kill_mid_batch(zk, job, run)
    run_to_end(zk, job, "--partitions", "2", "--fail-rate", "0.3")


@pytest.fixture
def own_pg() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, which it may kill."""
    with PostgresServer() as server:
        yield server


@pytest.mark.chaos
def test_postgres_killed_between_prepare_and_commit_prepared(zk, zk_server, zk_root, tmp_path, own_pg):
    """kill -9 of PostgreSQL while a query runs with epoch 0 prepared and not yet committed (daemon mode,
    no daemon: nothing commits). Its prepared transactions survive crash recovery; the query's later
    tasks may fail while the server is down; the restarted driver commits epoch 0 and the rest once."""
    job = make_job(zk_server, zk_root, tmp_path, own_pg.create_database("killed"))
    try:
        run = job.start("--coordinator", "daemon", "--slow-ms", str(SLOW_MS))
        wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
        prepared = prepared_left(job.dsn)
        own_pg.kill()
        own_pg.start()
        assert len(prepared) >= 4, "epoch 0's four partitions are not prepared"
        survived = set(prepared_left(job.dsn))
        assert set(prepared) <= survived, f"lost in the crash: {sorted(set(prepared) - survived)}"
        assert read_ids(job.dsn, TABLE) == [], "prepared rows are visible before the commit"
        # Its later tasks may have failed for good while the server was down: either way it ends.
        assert wait_exit(run, JOB_TIMEOUT) is not None, f"{run.label} did not exit\n{job.logs()}"

        # One more input file, so the restarted run plans a batch of its own even if the first one
        # got through all the input.
        write_input(str(job.input), job.batches, range(job.batches * ROWS_PER_BATCH, (job.batches + 1) * ROWS_PER_BATCH))
        job.batches += 1
        run_to_end(zk, job)
    finally:
        for run in job.runs:
            if run.proc.poll() is None:
                kill_run(run)



def test_example_without_arguments_runs_on_its_own():
    """The README's one command: private ZooKeeper and PostgreSQL, failing attempts, exactly once."""
    done = subprocess.run([sys.executable, "-m", MODULE], capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lost 0, duplicated 0, unexpected 0: EXACTLY ONCE" in done.stdout, done.stdout
    assert "prepared transactions left: 0" in done.stdout, done.stdout
