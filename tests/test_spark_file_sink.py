"""SparkFileSink's transaction, with a stand-in for Spark's writer that leaves what it leaves.

The real writer is in tests/test_spark_file_sink_spark.py; here every step of the protocol and its
failures: invisible until commit, commit and abort idempotent, lost files named, leftovers cleaned.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path

import cloudpickle
import pytest

from sinks.spark_files import FileSetHandle, SparkFileSink
from twophase.sink import AbortFailed, CommitFailed, TxnContext
from twophase.spark.sink_options import check_sink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeWrite:
    """``df.write`` as far as SparkFileSink drives it: writes what Spark's file writer leaves after a job
    commit, one ``part-<task>-<uuid>.c000<ext>`` per task (in ``k=v/`` with partitionBy), its hidden
    checksum, and ``_SUCCESS``."""

    def __init__(self, rows: list[dict], tasks: int) -> None:
        self.rows, self.tasks, self.calls = rows, tasks, {}

    def format(self, name):
        self.calls["format"] = name
        return self

    def options(self, **options):
        self.calls["options"] = options
        return self

    def partitionBy(self, *columns):  # noqa: N802 - Spark's name
        self.calls["partitionBy"] = columns
        return self

    def mode(self, mode):
        self.calls["mode"] = mode
        return self

    def save(self, path):
        assert self.calls["mode"] == "errorifexists"
        os.makedirs(path)
        columns = self.calls["partitionBy"]
        job = uuid.uuid4()
        for i, row in enumerate(self.rows):
            folder = Path(path, *(f"{c}={row[c]}" for c in columns))
            folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{i % self.tasks:05d}-{job}.c000.{self.calls['format']}"
            with open(folder / name, "a") as f:
                f.write(f"{row['id']}\n")
            (folder / f".{name}.crc").write_bytes(b"crc")
        Path(path, "_SUCCESS").touch()


class FakeConf:
    def __init__(self, settings: dict[str, str]) -> None:
        self.settings = settings

    def get(self, key, default):
        return self.settings.get(key, default)


class FakeSession:
    def __init__(self, settings: dict[str, str]) -> None:
        self.conf = FakeConf(settings)


class FakeFrame:
    def __init__(self, rows: list[dict], tasks: int = 2, settings: dict[str, str] | None = None) -> None:
        self.write = FakeWrite(rows, tasks)
        self.sparkSession = FakeSession(settings or {})


def ctx(epoch=0, run="run1"):
    return TxnContext("app", "q", run, epoch, 0, 0)


def visible_ids(path: Path) -> list[int]:
    """Every id in a visible file; a reader skips names starting with '_' or '.', and their contents."""
    ids = []
    for folder, subfolders, names in os.walk(path):
        subfolders[:] = [d for d in subfolders if not d.startswith(("_", "."))]
        for name in names:
            if not name.startswith(("_", ".")):
                ids.extend(int(line) for line in Path(folder, name).read_text().split())
    return sorted(ids)


def pre_committed(sink: SparkFileSink, rows: list[dict], epoch=0, run="run1") -> FileSetHandle:
    txn = sink.begin_transaction(ctx(epoch, run))
    sink.write_dataframe(txn, FakeFrame(rows))
    return sink.pre_commit(txn)


@pytest.fixture(params=[True, False], ids=["fsync", "nofsync"])
def sink(tmp_path, request):
    return SparkFileSink(str(tmp_path / "out"), format="json", fsync=request.param)


def test_invisible_until_commit_then_each_file_once_under_a_part_name(sink, tmp_path):
    handle = pre_committed(sink, [{"id": i} for i in range(5)], epoch=7)
    assert visible_ids(tmp_path / "out") == [] and len(handle.files) == 2
    assert os.listdir(tmp_path / "out" / "_staging") == []
    sink.commit(handle)
    assert visible_ids(tmp_path / "out") == [0, 1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "out")) == ["_pending", "_staging", "part-00000007-00000-run1-0.json",
                                                     "part-00000007-00001-run1-0.json"]
    assert os.listdir(tmp_path / "out" / "_pending") == []  # _SUCCESS and checksums went with the directory


def test_partition_directories_are_kept_and_made_at_commit(tmp_path):
    sink = SparkFileSink(str(tmp_path / "out"), format="json", partition_by=["day"])
    handle = pre_committed(sink, [{"id": i, "day": i % 2} for i in range(4)], epoch=3)
    assert not (tmp_path / "out" / "day=0").exists()
    sink.commit(handle)
    assert sorted(os.listdir(tmp_path / "out" / "day=1")) == ["part-00000003-00001-run1-0.json"]
    assert visible_ids(tmp_path / "out" / "day=0") == [0, 2]


def test_commit_twice_is_once_and_a_lost_file_is_named(sink, tmp_path):
    handle = pre_committed(sink, [{"id": 1}, {"id": 2}])
    sink.commit(handle)
    sink.commit(handle)
    assert visible_ids(tmp_path / "out") == [1, 2]
    lost = pre_committed(sink, [{"id": 3}], epoch=1)
    os.unlink(os.path.join(lost.pending, lost.files[0][0]))
    with pytest.raises(CommitFailed, match="lost"):
        sink.commit(lost)


def test_a_commit_interrupted_halfway_is_finished_by_the_next(sink, tmp_path):
    handle = pre_committed(sink, [{"id": i} for i in range(4)])
    first, final = handle.files[0]
    os.rename(os.path.join(handle.pending, first), os.path.join(handle.path, final))  # a crash after one rename
    sink.commit(handle)
    assert visible_ids(tmp_path / "out") == [0, 1, 2, 3]


def test_abort_discards_is_idempotent_and_refuses_a_committed_handle(sink, tmp_path):
    aborted = pre_committed(sink, [{"id": 1}])
    sink.abort(aborted)
    sink.abort(aborted)
    assert not os.path.exists(aborted.pending) and visible_ids(tmp_path / "out") == []
    committed = pre_committed(sink, [{"id": 2}], epoch=1)
    sink.commit(committed)
    with pytest.raises(AbortFailed, match="committed already"):
        sink.abort(committed)
    assert visible_ids(tmp_path / "out") == [2]


def test_a_failed_job_and_a_killed_driver_leave_nothing_visible_and_are_cleaned(sink, tmp_path):
    failed = sink.begin_transaction(ctx(0))
    os.makedirs(os.path.join(failed.staging, "_temporary", "0"))  # what a failed job leaves
    sink.abort_transaction(failed)
    assert not os.path.exists(failed.staging)
    killed_writing = sink.begin_transaction(ctx(1, run="dead"))
    sink.write_dataframe(killed_writing, FakeFrame([{"id": 1}]))
    killed_after = pre_committed(sink, [{"id": 2}], epoch=2, run="dead")
    assert visible_ids(tmp_path / "out") == []
    sink.abort_unregistered(ctx(1, run="dead"))
    sink.abort_unregistered(ctx(2, run="dead"))
    sink.abort_unregistered(ctx(2, run="dead"))
    assert not os.path.exists(killed_writing.staging) and not os.path.exists(killed_after.pending)


def test_an_empty_micro_batch_commits_nothing(sink, tmp_path):
    handle = pre_committed(sink, [])
    assert handle.files == () and os.listdir(tmp_path / "out" / "_staging") == []
    sink.commit(handle)
    sink.abort(handle)
    assert visible_ids(tmp_path / "out") == []


def test_options_and_partition_columns_reach_sparks_writer_and_one_dataframe_per_transaction(tmp_path):
    sink = SparkFileSink(str(tmp_path / "out"), format="csv", options={"header": "true"}, partition_by=["day"])
    txn = sink.begin_transaction(ctx())
    frame = FakeFrame([{"id": 1, "day": 1}])
    sink.write_dataframe(txn, frame)
    assert frame.write.calls == {"format": "csv", "options": {"header": "true"}, "partitionBy": ("day",),
                                 "mode": "errorifexists"}
    with pytest.raises(ValueError, match="one per micro-batch"):
        sink.write_dataframe(txn, FakeFrame([{"id": 2, "day": 1}]))


def test_rows_are_refused_and_row_writers_refuse_the_sink(tmp_path):
    sink = SparkFileSink(str(tmp_path / "out"))
    with pytest.raises(TypeError, match="TwoPhaseBatchSink"):
        sink.write(sink.begin_transaction(ctx()), {"id": 1})
    with pytest.raises(TypeError, match="TwoPhaseBatchSink in foreachBatch"):
        check_sink(sink, takes_rows=True)
    check_sink(sink, takes_rows=False)


@pytest.mark.parametrize("settings, named", [
    ({"format": "xml"}, "format='xml'"),
    ({"options": {"compression": 1}}, "options="),
    ({"options": {"PATH": "/elsewhere"}}, "'path' is the sink's own"),
    ({"partition_by": "day"}, "partition_by='day'"),
    ({"partition_by": [""]}, "partition_by="),
    ({"path": "hdfs://nn/data"}, "not a URL"),
    ({"partition_by": ["_source"]}, "directories readers skip"),
    ({"options": {"mapreduce.fileoutputcommitter.algorithm.version": "2"}}, "only version 1"),
    ({"path": "file:/data"}, "not a URL"),
])
def test_bad_settings_are_refused_by_name(tmp_path, settings, named):
    with pytest.raises(ValueError, match=named):
        SparkFileSink(**{"path": str(tmp_path / "out"), **settings})


def test_a_handle_commits_in_another_process(tmp_path):
    sink = SparkFileSink(str(tmp_path / "out"), format="json")
    handle = pre_committed(sink, [{"id": 1}, {"id": 2}])
    blob = cloudpickle.dumps((sink, handle))
    code = "import pickle, sys; sink, handle = pickle.loads(sys.stdin.buffer.read()); sink.commit(handle)"
    subprocess.run([sys.executable, "-c", code], input=blob, check=True, cwd="/", env={**os.environ, "PYTHONPATH": ROOT})
    assert visible_ids(tmp_path / "out") == [1, 2]
    assert pickle.loads(pickle.dumps(handle)) == handle


def test_check_target_names_the_partition_columns_a_micro_batch_lacks(tmp_path):
    import pyarrow as pa

    sink = SparkFileSink(str(tmp_path / "out"), partition_by=["day", "id"])
    with pytest.raises(ValueError, match=r"no column\(s\) \['day'\]"):
        sink.check_target(pa.schema([("id", pa.int64())]))
    sink.check_target(pa.schema([("id", pa.int64()), ("day", pa.string())]))
    sink.check_target(None)  # a schema pyarrow cannot spell: Spark's own error then


def test_a_session_with_the_version_2_committer_is_refused_before_spark_writes(tmp_path):
    settings = {"spark.hadoop.mapreduce.fileoutputcommitter.algorithm.version": "2"}
    sink = SparkFileSink(str(tmp_path / "out"))
    txn = sink.begin_transaction(ctx())
    with pytest.raises(ValueError, match="needs version 1"):
        sink.write_dataframe(txn, FakeFrame([{"id": 1}], settings=settings))
    assert not os.path.exists(txn.staging)
    overridden = SparkFileSink(str(tmp_path / "out"), options={"mapreduce.fileoutputcommitter.algorithm.version": "1"})
    overridden.write_dataframe(overridden.begin_transaction(ctx(1)), FakeFrame([{"id": 1}], settings=settings))


def test_every_directory_a_rename_changed_is_fsynced(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr("sinks.spark_files.fsync_dir", synced.append)
    out = tmp_path / "out"
    sink = SparkFileSink(str(out), format="json", partition_by=["day", "hour"])
    handle = pre_committed(sink, [{"id": 1, "day": 1, "hour": 2}], epoch=4)
    staging = str(out / "_staging" / "run1.4.0.0")
    assert synced == [f"{staging}/day=1/hour=2", f"{staging}/day=1", staging, str(out), str(out / "_pending")]
    synced.clear()
    sink.commit(handle)
    assert synced == [str(out / "day=1" / "hour=2"), str(out / "day=1"), str(out)]
