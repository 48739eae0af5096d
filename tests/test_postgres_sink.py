"""PostgresSink against a real PostgreSQL (tests/conftest.py's pg_server, or a server of the test's own),
driven directly and through the real coordinator on a real ZooKeeper (tests/harness.py), without Spark.
Every count comes from an independent reader: plain SQL on a connection of the test's own."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import pickle
import threading
import uuid

import cloudpickle
import psycopg
import pyarrow as pa
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from coordinator.report import AttemptCleanedUp, EpochCommitted, Operation, OperationFailed
from coordinator.state import EpochState
from coordinator.status import read_status
from sinks.postgres import LockTimeout, PostgresHandle, PostgresSink
from tests.harness import QUERY, SIGNER, Pipeline, stage
from tests.test_coordinator import records_of
from tests.test_log_sink import in_subprocess
from tests.test_sink_hooks import six_committed_epochs
from tests.waiting import wait_for, wait_until
from twophase.pgserver import PostgresServer
from twophase.sink import AbortFailed, CommitFailed, CommitOutcomeUnknown, TxnContext
from twophase.verify import count_rows


def execute(dsn, statement, params=None):
    """Run one statement on a connection of its own (autocommit); the rows if it returns any."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else None


def ids(dsn, table="t"):
    """The ids an independent reader sees in ``table``."""
    return [r[0] for r in execute(dsn, sql.SQL("SELECT id FROM {} ORDER BY id").format(sql.Identifier(table)))]


def prepared(dsn):
    return sorted(r[0] for r in execute(dsn, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"))


def markers(dsn):
    return sorted(tuple(r) for r in execute(dsn, "SELECT query_id, epoch FROM twophase_commits"))


def ctx(epoch=0, partition=0, attempt=0, run="r1", query=QUERY):
    return TxnContext("app", query, run, epoch, partition, attempt)


def prepare(sink, context, rows):
    return sink.pre_commit(stage(sink, context, rows))


@pytest.fixture
def sink(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")
    sink.check_target(pa.schema([("id", pa.int64())]))
    yield sink
    sink.close()


@pytest.fixture
def pipe(zk, zk_root, sink):
    pipe = Pipeline(zk, zk_root, sink)
    yield pipe
    pipe.close()


def test_the_coordinator_commits_every_row_exactly_once_and_nothing_before(pipe, pg_dsn):
    for epoch in range(2):
        for partition in range(3):
            first = epoch * 30 + partition * 10
            pipe.task("r1", epoch, partition, range(first, first + 10))
    assert pipe.task("r1", 0, 1, range(10, 20), attempt=1) is None  # a retry finds the winner: no second copy
    assert ids(pg_dsn) == [] and len(prepared(pg_dsn)) == 6         # durable, invisible
    pipe.barrier(1, "r1")
    report = pipe.coordinator().reconcile()
    assert [r.epoch for r in report.records if isinstance(r, EpochCommitted)] == [0, 1]
    assert count_rows(range(60), ids(pg_dsn)).exact and prepared(pg_dsn) == []
    assert markers(pg_dsn) == [(QUERY, 0)] * 3 + [(QUERY, 1)] * 3


def test_commit_twice_and_after_the_prepared_transaction_is_gone_is_once(sink, pg_dsn):
    handle = prepare(sink, ctx(), [{"id": i} for i in range(5)])
    sink.commit(handle)
    sink.commit(handle)
    assert ids(pg_dsn) == list(range(5))
    # A commit whose answer was lost: the transaction committed, the coordinator tries again.
    lost = prepare(sink, ctx(epoch=1), [{"id": 5}])
    execute(pg_dsn, sql.SQL("COMMIT PREPARED {}").format(sql.Literal(lost.gid)))
    sink.commit(lost)
    assert ids(pg_dsn) == list(range(6))


def test_a_handle_rolled_back_by_hand_can_never_commit(sink, pg_dsn):
    handle = prepare(sink, ctx(), [{"id": 1}])
    execute(pg_dsn, sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(handle.gid)))
    with pytest.raises(CommitFailed, match=handle.gid):
        sink.commit(handle)
    assert ids(pg_dsn) == [] and markers(pg_dsn) == []


def test_without_its_marker_table_a_lost_transactions_outcome_is_unknown(sink, pg_dsn):
    handle = prepare(sink, ctx(), [{"id": 1}])
    execute(pg_dsn, sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(handle.gid)))
    execute(pg_dsn, "DROP TABLE twophase_commits")  # by an operator
    with pytest.raises(CommitOutcomeUnknown, match="cannot tell whether it committed"):
        sink.commit(handle)
    with pytest.raises(RuntimeError, match="cannot tell whether it committed"):
        sink.abort(handle)


def test_abort_discards_is_idempotent_and_refuses_a_committed_handle(sink, pg_dsn):
    aborted = prepare(sink, ctx(partition=0), [{"id": 1}])
    sink.abort(aborted)
    sink.abort(aborted)
    assert prepared(pg_dsn) == [] and ids(pg_dsn) == []
    committed = prepare(sink, ctx(partition=1), [{"id": 2}])
    sink.commit(committed)
    with pytest.raises(AbortFailed, match="committed already"):
        sink.abort(committed)
    assert ids(pg_dsn) == [2]


def test_abort_transaction_before_prepare_leaves_nothing(sink, pg_dsn):
    txn = stage(sink, ctx(), [{"id": i} for i in range(3)])
    sink.write_batch(txn, pa.RecordBatch.from_pydict({"id": [7, 8]}))  # a COPY on the server already
    sink.abort_transaction(txn)
    sink.abort_transaction(txn)
    assert ids(pg_dsn) == [] and prepared(pg_dsn) == [] and markers(pg_dsn) == []
    wait_until(lambda: execute(pg_dsn, "SELECT count(*) FROM pg_stat_activity WHERE "
                                       "application_name = 'twophase r1.0.0.0'") == [(0,)], what="the backend to end")


def test_an_attempt_without_rows_prepares_nothing(sink, pg_dsn):
    handle = prepare(sink, ctx(), [])
    assert handle.gid is None and prepared(pg_dsn) == []
    sink.commit(handle)
    sink.abort(handle)


def test_abort_unregistered_rolls_back_the_dead_attempts_prepared_transaction_only(sink, pg_dsn):
    dead, alive = ctx(partition=1, attempt=0), ctx(partition=1, attempt=1)
    prepare(sink, dead, [{"id": 999}])
    survivor = prepare(sink, alive, [{"id": 1}])
    sink.abort_unregistered(dead)
    sink.abort_unregistered(dead)
    assert prepared(pg_dsn) == [survivor.gid]
    sink.commit(survivor)
    assert ids(pg_dsn) == [1]


# A task in a process of its own: prepares its rows, prints its pickled handle and exits at once
# (os._exit: no cleanup of any kind, as a kill right after PREPARE would leave it).
WRITER = ("import os\n"
          "from tests.harness import stage\n"
          "sink, context, rows = args\n"
          "print(cloudpickle.dumps(sink.pre_commit(stage(sink, context, rows))).hex(), flush=True)\n"
          "os._exit(0)\n")


def test_phase_one_and_phase_two_in_processes_of_their_own(sink, pg_dsn):
    """A writer process prepares and exits; this process commits. One that exits without registering
    leaves its transaction prepared, for abort_unregistered. A fresh interpreter commits."""
    out = in_subprocess(WRITER, sink, ctx(run="writer"), [{"id": i} for i in range(20)])
    handle = cloudpickle.loads(bytes.fromhex(out.strip().splitlines()[-1]))
    assert isinstance(handle, PostgresHandle) and ids(pg_dsn) == []
    sink.commit(handle)
    in_subprocess(WRITER, sink, ctx(run="dead"), [{"id": 999}])
    assert prepared(pg_dsn) == [sink.gid(ctx(run="dead"))]
    sink.abort_unregistered(ctx(run="dead"))
    later = prepare(sink, ctx(run="r2"), [{"id": 20}])
    in_subprocess("sink, handle = args\nsink.commit(handle)\n", sink, later)
    assert ids(pg_dsn) == list(range(21)) and prepared(pg_dsn) == []


def test_the_coordinator_cleans_up_an_attempt_killed_after_prepare(pipe, pg_dsn):
    dead = ctx(partition=1)
    pipe.registry.intend(dead)
    prepare(pipe.sink, dead, [{"id": 999}])  # then killed before registering its handle
    pipe.task("r1", 0, 0, range(10))
    pipe.task("r1", 0, 1, range(10, 20), attempt=1)
    pipe.barrier(0, "r1")
    report = pipe.coordinator().reconcile()
    assert [r for r in report.records if isinstance(r, AttemptCleanedUp)] == [AttemptCleanedUp(QUERY, 0, "r1.0.1.0")]
    assert count_rows(range(20), ids(pg_dsn)).exact and prepared(pg_dsn) == []


def test_retire_epoch_deletes_the_markers_of_that_query_up_to_the_epoch(sink, pg_dsn):
    for query in ("q-1", "q-2"):
        for epoch in range(4):
            sink.commit(prepare(sink, ctx(epoch=epoch, query=query), [{"id": epoch}]))
    sink.retire_epoch("app", "q-1", 1)
    sink.retire_epoch("app", "q-1", 1)
    sink.retire_epoch("other-app", "q-2", 3)
    assert markers(pg_dsn) == [("q-1", 2), ("q-1", 3)] + [("q-2", e) for e in range(4)]


def test_the_coordinator_retires_markers_beyond_its_retention(pipe, pg_dsn):
    six_committed_epochs(pipe)
    app = pipe.coordinator(retain_epochs=2)
    app.reconcile()
    app.reconcile()
    assert markers(pg_dsn) == [(QUERY, 4), (QUERY, 5)]
    assert count_rows(range(60), ids(pg_dsn)).exact


@pytest.fixture
def upsert(pg_dsn):
    execute(pg_dsn, "CREATE TABLE stock (sku text PRIMARY KEY, qty int, note text)")
    sink = PostgresSink(pg_dsn, "stock", mode="upsert", key="sku", lock_timeout=2)
    sink.check_target(pa.schema([("sku", pa.string()), ("qty", pa.int32()), ("note", pa.string())]))
    yield sink
    sink.close()


def stock(dsn):
    return execute(dsn, "SELECT sku, qty, note FROM stock ORDER BY sku")


def test_upsert_the_last_row_of_a_key_in_an_attempt_wins(upsert, pg_dsn):
    txn = upsert.begin_transaction(ctx())
    upsert.write(txn, {"sku": "a", "qty": 1, "note": "row 1"})
    upsert.write_batch(txn, pa.RecordBatch.from_pylist(
        [{"sku": "b", "qty": 2, "note": "batch"}, {"sku": "a", "qty": 3, "note": "batch"}],
        schema=pa.schema([("sku", pa.string()), ("qty", pa.int32()), ("note", pa.string())])))
    upsert.write(txn, {"sku": "b", "qty": 4, "note": "row 2"})
    upsert.commit(upsert.pre_commit(txn))
    assert stock(pg_dsn) == [("a", 3, "batch"), ("b", 4, "row 2")]
    assert execute(pg_dsn, "SELECT count(*) FROM pg_class WHERE relname LIKE '_twophase_stage_%'") == [(0,)]


def test_upsert_a_later_epoch_wins_even_while_the_earlier_one_is_still_prepared(upsert, pg_dsn):
    upsert.commit(prepare(upsert, ctx(epoch=0), [{"sku": "a", "qty": 1, "note": "e0"},
                                                 {"sku": "b", "qty": 1, "note": "e0"}]))
    first = prepare(upsert, ctx(epoch=1), [{"sku": "a", "qty": 2, "note": "e1"}])
    later = {}
    # Epoch 2 starts before epoch 1 committed: its merge waits for epoch 1's prepared row.
    writer = threading.Thread(target=lambda: later.update(handle=prepare(
        upsert, ctx(epoch=2), [{"sku": "a", "qty": 3, "note": "e2"}])))
    writer.start()
    upsert.commit(first)
    writer.join(60)
    upsert.commit(later["handle"])
    assert stock(pg_dsn) == [("a", 3, "e2"), ("b", 1, "e0")]


def test_upsert_refuses_rows_without_the_key(upsert, pg_dsn):
    txn = upsert.begin_transaction(ctx())
    with pytest.raises(ValueError, match=r"key=\['sku'\]: rows with the columns \['qty'\] lack a key column"):
        upsert.write(txn, {"qty": 1})
    upsert.abort_transaction(txn)


def test_upsert_one_key_in_two_partitions_of_an_epoch_fails_loudly(upsert, pg_dsn):
    held = prepare(upsert, ctx(partition=0), [{"sku": "a", "qty": 1, "note": "p0"}])
    upsert.lock_timeout = 0.2
    with pytest.raises(LockTimeout, match=r"repartition"):
        prepare(upsert, ctx(partition=1), [{"sku": "a", "qty": 2, "note": "p1"}])
    upsert.abort(held)


def test_upsert_after_a_crash_a_dead_attempts_prepared_key_does_not_block_the_new_run(upsert, zk, zk_root, pg_dsn):
    """Run r1's task prepared key 'a' and died before registering (its driver was killed): the coordinator
    rolls it back as soon as run r2 begins the epoch, so r2's upsert of 'a' neither waits nor fails."""
    with Pipeline(zk, zk_root, upsert) as pipe:
        pipe.registry.ensure_run("r1")
        dead = ctx(run="r1")
        pipe.registry.intend(dead)
        prepare(upsert, dead, [{"sku": "a", "qty": 1, "note": "r1"}])
        running = pipe.begin("r2", 0, 0)
        app = pipe.coordinator()
        assert records_of(app.reconcile(), AttemptCleanedUp) == [AttemptCleanedUp(QUERY, 0, "r1.0.0.0")]
        assert prepared(pg_dsn) == []
        running.write({"sku": "a", "qty": 2, "note": "r2"})
        running.close(None)
        assert running.won
        pipe.barrier(0, "r2")
        app.reconcile()
        assert stock(pg_dsn) == [("a", 2, "r2")] and pipe.watermark() == 0


def test_append_one_key_of_a_unique_index_in_two_partitions_fails_loudly(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint PRIMARY KEY)")
    sink = PostgresSink(pg_dsn, "t", lock_timeout=0.2)
    sink.check_target(None)
    held = prepare(sink, ctx(partition=0), [{"id": 1}])
    with pytest.raises(LockTimeout, match=r"partition the rows by that key"):
        prepare(sink, ctx(partition=1), [{"id": 1}])
    sink.commit(held)
    assert ids(pg_dsn) == [1]


def test_upsert_needs_a_unique_index_on_exactly_the_key(pg_dsn):
    execute(pg_dsn, "CREATE TABLE s (sku text, qty int, UNIQUE (sku, qty))")
    sink = PostgresSink(pg_dsn, "s", mode="upsert", key="sku")
    with pytest.raises(ValueError, match=r"no unique index or constraint on exactly these columns.*UNIQUE \(sku\)"):
        sink.check_target(pa.schema([("sku", pa.string()), ("qty", pa.int32())]))
    execute(pg_dsn, "CREATE UNIQUE INDEX ON s (sku) WHERE qty > 0")  # partial: ON CONFLICT (sku) cannot use it
    with pytest.raises(ValueError, match="no unique index"):
        sink.check_target(None)
    execute(pg_dsn, "CREATE UNIQUE INDEX ON s (sku)")
    sink.check_target(None)


@pytest.mark.parametrize("setup, schema, columns, message", [
    ("", [("id", pa.int64())], None, r"table=\"t\": no such table"),
    ("CREATE TABLE t (id bigint)", [("id", pa.int64()), ("name", pa.string())], None, r"no column 'name'"),
    ("CREATE TABLE t (id integer)", [("id", pa.int64())], None,
     r"column 'id' of \"t\" is integer; the query's int64 cannot be written to it"),
    ("CREATE TABLE t (id bigint, at date)", [("id", pa.int64()), ("at", pa.timestamp("us", tz="UTC"))], None,
     r"column 'at' of \"t\" is date; the query's timestamp\[us, tz=UTC\] cannot be written"),
    ("CREATE TABLE t (id bigint, n numeric(5,2))", [("id", pa.int64()), ("n", pa.decimal128(10, 2))], None,
     r"numeric\(5,2\); the query's decimal128\(10, 2\)"),
    ("CREATE TABLE t (id bigint, tags text)", [("id", pa.int64()), ("tags", pa.list_(pa.string()))], None,
     r"Nested types are not written"),
    ("CREATE TABLE t (id bigint, x bigint GENERATED ALWAYS AS (id * 2) STORED)",
     [("id", pa.int64()), ("x", pa.int64())], None, r"column 'x' of \"t\" is generated"),
    ("CREATE TABLE t (id bigint, name text NOT NULL)", [("id", pa.int64())], None,
     r"column 'name' of \"t\" is NOT NULL without a default"),
    ("CREATE TABLE t (id bigint, name text)", [("id", pa.int64()), ("name", pa.string())], ["id"],
     r"the query's fields \['name'\] would not be written"),
    ("CREATE VIEW t AS SELECT 1::bigint AS id", [("id", pa.int64())], None, r"is not a table"),
])
def test_check_target_refuses_what_cannot_take_the_rows(pg_dsn, setup, schema, columns, message):
    if setup:
        execute(pg_dsn, setup)
    with pytest.raises(ValueError, match=message):
        PostgresSink(pg_dsn, "t", columns=columns).check_target(pa.schema(schema))
    assert execute(pg_dsn, "SELECT to_regclass('twophase_commits')") == [(None,)]  # refused before creating it


def test_check_target_accepts_what_can_be_written(pg_dsn):
    execute(pg_dsn, "CREATE TABLE public.t (id bigint, small integer, f real, d double precision, n numeric(12,2), "
                    "s varchar(10), j jsonb, u uuid, b boolean, raw bytea, day date, at timestamptz, "
                    "wall timestamp, created timestamptz DEFAULT now(), note text)")
    schema = pa.schema([("id", pa.int64()), ("small", pa.int16()), ("f", pa.float32()), ("d", pa.int32()),
                        ("n", pa.decimal128(10, 2)), ("s", pa.string()), ("j", pa.string()), ("u", pa.string()),
                        ("b", pa.bool_()), ("raw", pa.binary()), ("day", pa.date32()),
                        ("at", pa.timestamp("us")), ("wall", pa.timestamp("us", tz="UTC")), ("note", pa.null())])
    PostgresSink(pg_dsn, "public.t").check_target(schema)
    PostgresSink(pg_dsn, "t", columns=["id", "at"]).check_target(None)
    with pytest.raises(ValueError, match="no column 'nope'"):
        PostgresSink(pg_dsn, "t", columns=["id", "nope"]).check_target(None)


def test_check_target_creates_the_marker_table_once_among_concurrent_creators(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sinks = [PostgresSink(pg_dsn, "t") for _ in range(4)]
    errors = []
    start = threading.Barrier(len(sinks))

    def check(sink):
        start.wait()
        try:
            sink.check_target(None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=check, args=(s,)) for s in sinks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert execute(pg_dsn, "SELECT count(*) FROM twophase_commits") == [(0,)]


def test_check_target_does_not_wait_for_prepared_transactions_holding_marker_rows(sink, pg_dsn):
    held = prepare(sink, ctx(), [{"id": 1}])  # a restarted query's driver checks while this waits for commit
    sink.check_target(None)
    PostgresSink(pg_dsn, "t", marker_table="public.twophase_commits").check_target(None)
    sink.commit(held)
    assert ids(pg_dsn) == [1]


def test_check_target_refuses_a_server_without_prepared_transactions():
    with PostgresServer(max_prepared_transactions=0) as server:
        dsn = server.create_database("d")
        execute(dsn, "CREATE TABLE t (id bigint)")
        with pytest.raises(ValueError, match="max_prepared_transactions = 0.*postgresql.conf"):
            PostgresSink(dsn, "t").check_target(None)


def test_a_task_finding_no_marker_table_fails_clearly(pg_dsn):
    execute(pg_dsn, "CREATE TABLE t (id bigint)")
    sink = PostgresSink(pg_dsn, "t")  # check_target never ran
    with pytest.raises(RuntimeError, match="marker_table='twophase_commits' does not exist.*check_target"):
        prepare(sink, ctx(), [{"id": 1}])
    assert prepared(pg_dsn) == [] and ids(pg_dsn) == []


@pytest.mark.parametrize("dsn, message", [
    ("host=h dbname=d password=s3cret", "holds a password.*PGPASSWORD.*PGPASSFILE"),
    ("postgresql://u:s3cret@h/d", "holds a password"),
    ("host=h dbname=d sslpassword=s3cret", "holds a sslpassword"),
    ("host=h user=u", "names no dbname="),
    ("host=h dbname=d password s3cret", r"not a libpq connection string \(key=value"),
])
def test_a_dsn_with_a_secret_or_without_a_database_is_refused(dsn, message):
    with pytest.raises(ValueError, match=message) as refused:
        PostgresSink(dsn, "t")
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "merge"}, "mode='merge'"),
    ({"mode": "upsert"}, "key= is required by upsert"),
    ({"key": "id"}, "key= is required by upsert and only by upsert"),
    ({"mode": "upsert", "key": "id", "columns": ["name"]}, "every key column must be in columns="),
    ({"lock_timeout": 0}, "lock_timeout=0"),
    ({"marker_table": "a.b.c"}, "marker_table='a.b.c'"),
])
def test_bad_settings_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PostgresSink("host=h dbname=d", "t", **kwargs)


@pytest.fixture
def passworded():
    with PostgresServer(password="s3cret-pw") as server:
        yield server


def test_the_password_comes_from_the_environment_and_is_never_stored(passworded, monkeypatch, tmp_path):
    with_password = passworded.create_database("d")
    execute(with_password, "CREATE TABLE t (id bigint)")
    with pytest.raises(ValueError, match="holds a password"):
        PostgresSink(with_password, "t")
    params = conninfo_to_dict(with_password)
    del params["password"]
    dsn = make_conninfo(**params)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "none"))
    sink = PostgresSink(dsn, "t")
    with pytest.raises(psycopg.OperationalError, match="password"):
        sink.check_target(None)
    monkeypatch.setenv("PGPASSWORD", "s3cret-pw")
    sink.check_target(None)
    handle = prepare(sink, ctx(), [{"id": 1}])
    monkeypatch.delenv("PGPASSWORD")
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{passworded.port}:d:postgres:s3cret-pw\n")
    passfile.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(passfile))
    with contextlib.closing(pickle.loads(pickle.dumps(sink))) as restored:  # the coordinator's copy
        restored.commit(handle)
    assert ids(with_password) == [1]
    for kept in (pickle.dumps(sink), cloudpickle.dumps(sink), pickle.dumps(handle), repr(sink), repr(handle)):
        assert (b"s3cret" if isinstance(kept, bytes) else "s3cret") not in kept


def test_a_postgres_killed_between_prepare_and_commit_prepared_keeps_the_epoch(zk, zk_root):
    with PostgresServer() as server:
        dsn = server.create_database("d")
        execute(dsn, "CREATE TABLE t (id bigint)")
        sink = PostgresSink(dsn, "t")
        sink.check_target(None)
        with Pipeline(zk, zk_root, sink) as pipe:
            for partition in range(3):
                pipe.task("r1", 0, partition, range(partition * 100, partition * 100 + 100))
            pipe.barrier(0, "r1")
            server.kill()
            app = pipe.coordinator(attempts=2, max_backoff=0.01)
            down = app.reconcile()  # every commit fails while the server is down, and is retried
            assert {(r.operation, r.permanent) for r in down.records if isinstance(r, OperationFailed)} == {
                (Operation.COMMIT, False)}
            assert pipe.record(0).state is EpochState.COMMITTING and pipe.watermark() == -1
            server.start()
            assert len(prepared(dsn)) == 3  # prepared transactions survive the crash
            assert app.reconcile().ok
            assert count_rows(range(300), ids(dsn)).exact and prepared(dsn) == [] and pipe.watermark() == 0


def test_prepared_transactions_lists_old_ones_naming_this_apps_attempts(pipe, sink, pg_dsn, zk, pg_server):
    mine = [prepare(sink, ctx(partition=p), [{"id": p}]) for p in range(2)]
    execute(pg_dsn, "CREATE TABLE other (id bigint)")
    other = PostgresSink(pg_dsn, "other")
    other.check_target(None)
    theirs = prepare(other, ctx(partition=5), [{"id": 5}])
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (42)")
        conn.execute("PREPARE TRANSACTION 'someone-else'")
    here = f"database {sink.database}"
    listed = wait_for(lambda: {t.id: t.attempt for t in sink.prepared_transactions(0) if t.where == here}
                      if len([t for t in sink.prepared_transactions(0) if t.where == here]) == 4 else None,
                      what="four prepared transactions older than 0 s")
    assert listed == {mine[0].gid: "r1.0.0.0", mine[1].gid: "r1.0.1.0", theirs.gid: None, "someone-else": None}
    assert sink.prepared_transactions(3600) == []
    status = read_status(zk, pipe.paths, SIGNER, prepared_older_than=0)  # `twophase status`, from the stored sink
    assert status.prepared_error is None and {mine[0].gid, "someone-else"} <= {t.id for t in status.prepared}
    for gid in prepared(pg_dsn):
        execute(pg_dsn, sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


TYPES = ("CREATE TABLE {} (id bigint, small integer, f double precision, n numeric(10,2), s text, j jsonb, "
         "b boolean, raw bytea, day date, at timestamptz, wall timestamp)")
SCHEMA = pa.schema([("id", pa.int64()), ("small", pa.int32()), ("f", pa.float64()), ("n", pa.decimal128(10, 2)),
                    ("s", pa.string()), ("j", pa.string()), ("b", pa.bool_()), ("raw", pa.binary()),
                    ("day", pa.date32()), ("at", pa.timestamp("us", tz="UTC")), ("wall", pa.timestamp("us"))])


def test_write_and_write_batch_store_the_same_rows(pg_dsn):
    utc = datetime.timezone.utc
    batch = pa.RecordBatch.from_pylist([
        {"id": 1, "small": -5, "f": 1.5, "n": decimal.Decimal("12.34"), "s": 'comma, "quote"\nline\\back', "j": '{"a": [1, 2]}',
         "b": True, "raw": b"\x00\xff\\", "day": datetime.date(2026, 2, 28),
         "at": datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=utc), "wall": datetime.datetime(2026, 1, 2, 3, 4, 5)},
        {"id": 2, "small": None, "f": float("nan"), "n": None, "s": "", "j": None, "b": False, "raw": b"",
         "day": None, "at": None, "wall": None},
        {"id": 3, "small": 2**31 - 1, "f": float("-inf"), "n": decimal.Decimal("-0.01"), "s": None, "j": "[]",
         "b": None, "raw": None, "day": datetime.date(1, 1, 1), "at": datetime.datetime(1970, 1, 1, tzinfo=utc),
         "wall": datetime.datetime(9999, 12, 31, 23, 59, 59, 999999)},
        {"id": 4, "small": 0, "f": 1e-300, "n": decimal.Decimal("99999999.99"), "s": "ünïcödé ✓ \t tab", "j": '"x"',
         "b": True, "raw": b"\n\r", "day": datetime.date(2026, 12, 31),
         "at": datetime.datetime(2026, 6, 30, 23, 59, 59, 999999, tzinfo=utc), "wall": datetime.datetime(2000, 1, 1)},
    ], schema=SCHEMA)
    tables = {}
    for path in ("rows", "batch"):
        execute(pg_dsn, sql.SQL(TYPES).format(sql.Identifier(path)))
        sink = PostgresSink(pg_dsn, path)
        sink.check_target(SCHEMA)
        txn = sink.begin_transaction(ctx())
        if path == "rows":
            for row in batch.to_pylist():
                sink.write(txn, row)
        else:
            sink.write_batch(txn, batch)
        sink.commit(sink.pre_commit(txn))
        tables[path] = execute(pg_dsn, sql.SQL("SELECT t::text FROM {} t ORDER BY id").format(sql.Identifier(path)))
    assert len(tables["rows"]) == 4 and tables["rows"] == tables["batch"]
    assert execute(pg_dsn, "SELECT s, raw, at, f::text FROM batch WHERE id = 1") == [
        ('comma, "quote"\nline\\back', b"\x00\xff\\", datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=utc), "1.5")]


def test_write_takes_spark_rows_and_refuses_rows_of_other_columns(sink, pg_dsn):
    from pyspark.sql import Row

    txn = sink.begin_transaction(ctx())
    sink.write(txn, Row(id=1))
    sink.write(txn, {"id": 2})
    with pytest.raises(ValueError, match=r"a row with the fields \['id', 'name'\]"):
        sink.write(txn, {"id": 3, "name": "x"})
    sink.commit(sink.pre_commit(txn))
    assert ids(pg_dsn) == [1, 2]


def test_many_rows_through_write_are_loaded_in_several_copies(sink, pg_dsn, monkeypatch):
    monkeypatch.setattr("sinks.postgres.ROW_BUFFER", 100)
    txn = sink.begin_transaction(ctx())
    for i in range(250):
        sink.write(txn, {"id": i})
    sink.write_batch(txn, pa.RecordBatch.from_pydict({"id": pa.array([250, 251], pa.int64())}))
    sink.commit(sink.pre_commit(txn))
    assert count_rows(range(252), ids(pg_dsn)).exact


def test_the_handle_is_small_plain_and_names_the_attempt(sink):
    handle = prepare(sink, ctx(), [{"id": 1}])
    assert isinstance(handle, PostgresHandle) and pickle.loads(pickle.dumps(handle)) == handle
    assert handle.gid.startswith("tp1:") and handle.gid.endswith(":r1.0.0.0") and len(pickle.dumps(handle)) < 1024
    sink.abort(handle)
    with pytest.raises(ValueError, match="over PostgreSQL's 200 bytes"):
        sink.gid(ctx(run="r" * 200))
    assert sink.gid(ctx(run=str(uuid.uuid4()))) != sink.gid(ctx(run=str(uuid.uuid4())))
