"""Chaos: the driver of a real streaming job dies, fails or changes shape; output stays exactly once.

Each test runs examples/file_sink_query.py (or tests/driver_job.py, the same
job with a poisoned partition) as a real subprocess in its own session against
the test session's ZooKeeper, kills or fails it at a point chosen by watching
ZooKeeper and the checkpoint, restarts it with the same checkpoint, and then
checks the output with an independent reader: every input id exactly once,
and nothing visible but committed ``part-*.jsonl`` files.

Cases (docs/failure-cases.md): 4 driver SIGKILLed mid-batch; 5 driver killed
after commits/N but before the coordinator committed N; 9 restart with a
different partition count; 10 a run fails for good.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from coordinator.layout import AppPaths, QueryPaths
from examples.demo_processes import spark_scratch_env
from examples.file_sink_query import write_input
from sinks.files import read_committed_rows
from tests.driver_job import POISON_ENV, POISON_EPOCH
from tests.waiting import wait_for, wait_until
from twophase.sink import TxnContext
from twophase.verify import count_rows

pytestmark = [pytest.mark.chaos, pytest.mark.spark]

REPO = Path(__file__).resolve().parents[1]
APP = "chaos"
ROWS_PER_BATCH = 40
SLOW_MS = 50           # 10 rows per task: a task takes ~0.5 s, a batch (2 waves) ~1 s
JOB_TIMEOUT = 180.0    # a whole run, JVM start included
EVENT_TIMEOUT = 90.0   # waiting for a ZooKeeper / checkpoint event in a running job
POLL = 0.05

# FileSink's committed names: part-<epoch:08d>-<partition:05d>-<run id>-<attempt>.jsonl
PART = re.compile(r"part-(\d{8})-(\d{5})-(.+)-(\d+)\.jsonl")


# -- the job as a subprocess ------------------------------------------------


@dataclass
class Run:
    proc: subprocess.Popen
    log: Path
    label: str

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as e:
            return f"<no log: {e}>"
        # Spark's console progress bar is \r-separated; keep the log readable.
        text = re.sub(r"\[Stage [^\]]*\][^\n\[]*", "", text.replace("\r", "\n"))
        kept = [line for line in text.splitlines() if line.strip()]
        return f"--- last {lines} lines of {self.log} ({self.label}) ---\n" + "\n".join(kept[-lines:])


@dataclass
class Job:
    """One pipeline (input, output, checkpoint, ZooKeeper root) that several runs share."""

    zk_hosts: str
    root: str
    tmp: Path
    batches: int
    runs: list[Run] = field(default_factory=list)

    @property
    def input(self) -> Path:
        return self.tmp / "in"

    @property
    def output(self) -> Path:
        return self.tmp / "out"

    @property
    def checkpoint(self) -> Path:
        return self.tmp / "ck"

    @property
    def expected(self) -> range:
        return range(self.batches * ROWS_PER_BATCH)

    def write_input(self) -> None:
        for b in range(self.batches):
            write_input(str(self.input), b, range(b * ROWS_PER_BATCH, (b + 1) * ROWS_PER_BATCH))

    def command(self, module: str, flags: tuple[str, ...]) -> list[str]:
        return [sys.executable, "-m", module, "--zk", self.zk_hosts, "--root", self.root, "--app", APP,
                "--input", str(self.input), "--output", str(self.output),
                "--checkpoint", str(self.checkpoint), *flags]

    def start(self, *flags: str, module: str = "examples.file_sink_query",
              env: dict[str, str] | None = None) -> Run:
        label = f"run {len(self.runs) + 1}: {module} {' '.join(flags)}".strip()
        log = self.tmp / f"run-{len(self.runs) + 1}.log"
        cmd = self.command(module, flags)
        full_env = dict(os.environ)
        full_env.pop(POISON_ENV, None)
        full_env.update({
            **spark_scratch_env(str(self.tmp / "scratch")),  # a SIGKILLed driver's Spark scratch stays in tmp_path
            "PYTHONPATH": str(REPO),
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "TWOPHASE_SECRET": os.environ["TWOPHASE_SECRET"],
        })
        full_env.update(env or {})
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.tmp, env=full_env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        run = Run(proc, log, label)
        self.runs.append(run)
        return run

    def logs(self) -> str:
        return "\n".join(run.tail() for run in self.runs)

    def run_to_end(self, *flags: str, **kwargs) -> Run:
        """Start a run and wait for it to exit 0."""
        run = self.start(*flags, **kwargs)
        rc = wait_exit(run, JOB_TIMEOUT)
        assert rc == 0, f"{run.label} exited {rc}\n{self.logs()}"
        return run


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_run(run: Run) -> None:
    """SIGKILL the driver's whole process tree, as a lost host would, and wait until it is gone.

    killpg takes the driver and its JVM (same session); PySpark's worker daemon
    puts itself in a process group of its own, so its workers are killed by pid
    too: no writer of the dead run may linger into the next one.
    """
    tree = _descendants(run.proc.pid)
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in tree + _descendants(run.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    run.proc.wait(timeout=30)
    wait_until(lambda: not any(_alive(pid) for pid in tree), 30, POLL, f"processes of {run.label} to die: {tree}")


def wait_exit(run: Run, timeout: float) -> int | None:
    try:
        return run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def wait_while_alive(what: str, condition: Callable[[], object], job: Job, run: Run,
                     timeout: float = EVENT_TIMEOUT):
    """Await `condition` while `run` is alive and return its truthy value; fail with the job's logs."""

    def condition_or_exit():
        value = condition()
        if not value and run.proc.poll() is not None:
            pytest.fail(f"{run.label} exited {run.proc.returncode} before {what}\n{job.logs()}")
        return value

    try:
        return wait_for(condition_or_exit, timeout, POLL, what)
    except AssertionError as e:
        pytest.fail(f"{e}\n{job.logs()}")


@pytest.fixture
def job(zk_server, zk_root, tmp_path) -> Iterator[Job]:
    job = Job(zk_server.hosts, zk_root, tmp_path, batches=5)
    yield job
    for run in job.runs:  # a failed test must not leave a driver behind
        if run.proc.poll() is None:
            kill_run(run)


# -- ZooKeeper and checkpoint, read independently of the product ------------


def app_paths(job: Job) -> AppPaths:
    return AppPaths(job.root, APP)


def query_paths(zk: KazooClient, job: Job) -> QueryPaths | None:
    try:
        queries = zk.get_children(app_paths(job).queries)
    except NoNodeError:
        return None
    assert len(queries) <= 1, f"one query expected, found {queries}"
    return app_paths(job).query(queries[0]) if queries else None


def read_json(zk: KazooClient, path: str):
    try:
        raw, _ = zk.get(path)
    except NoNodeError:
        return None
    return json.loads(raw) if raw else None


def watermark(zk: KazooClient, job: Job) -> int:
    qp = query_paths(zk, job)
    data = read_json(zk, qp.watermark) if qp else None
    return data["epoch"] if data else -1


def children(zk: KazooClient, path: str) -> list[str]:
    try:
        return zk.get_children(path)
    except NoNodeError:
        return []


def spark_completed(job: Job, epoch: int) -> bool:
    return (job.checkpoint / "commits" / str(epoch)).exists()


def precommitted_open_epoch(zk: KazooClient, job: Job) -> tuple[int, list[str]] | None:
    """An epoch with registered pre-commits that neither Spark nor the coordinator completed yet."""
    qp = query_paths(zk, job)
    if qp is None:
        return None
    mark = watermark(zk, job)
    for name in sorted(children(zk, qp.epochs)):
        epoch = int(name)
        attempts = children(zk, qp.attempts(epoch))
        if epoch > mark and attempts and not spark_completed(job, epoch):
            return epoch, attempts
    return None


def kill_mid_batch(zk: KazooClient, job: Job, run: Run) -> tuple[int, set[str], bool]:
    """Kill `run` while some epoch is pre-committed in part; return (epoch, its runs, re-run expected)."""
    epoch, attempts = wait_while_alive("pre-commits of an uncommitted epoch", lambda: precommitted_open_epoch(zk, job),
                               job, run)
    kill_run(run)
    killed_runs = {TxnContext.from_name(APP, "", name).run_id for name in attempts}  # only the run matters
    rerun = not spark_completed(job, epoch)  # else commits/N landed in the instant before the kill
    assert watermark(zk, job) < epoch or not rerun, "a killed run's incomplete epoch was committed"
    return epoch, killed_runs, rerun


# -- the independent reader ---------------------------------------------------


def visible_parts(output: Path) -> dict[tuple[int, int], str]:
    """(epoch, partition) -> run id of every visible file; fails on anything else visible."""
    if not output.exists():
        return {}
    parts: dict[tuple[int, int], str] = {}
    for name in sorted(os.listdir(output)):
        if name.startswith(("_", ".")):
            continue
        match = PART.fullmatch(name)
        assert match and (output / name).is_file(), f"visible but not a committed part file: {name}"
        key = (int(match[1]), int(match[2]))
        assert key not in parts, f"epoch {key[0]} partition {key[1]} committed twice: {name}, run {parts[key]}"
        parts[key] = match[3]
    return parts


def pending_of_epoch(job: Job, epoch: int) -> list[str]:
    """Pre-committed, not yet committed files of `epoch`: _pending/<run>.<epoch>.<partition>.<attempt>.jsonl."""
    pending = job.output / "_pending"
    names = sorted(os.listdir(pending)) if pending.exists() else []
    return [n for n in names if n.removesuffix(".jsonl").rsplit(".", 3)[1] == str(epoch)]


def assert_exactly_once(job: Job) -> dict[tuple[int, int], str]:
    parts = visible_parts(job.output)
    runs_per_epoch: dict[int, set[str]] = {}
    for (epoch, _), run in parts.items():
        runs_per_epoch.setdefault(epoch, set()).add(run)
    mixed = {e: r for e, r in runs_per_epoch.items() if len(r) > 1}
    assert not mixed, f"epochs committed from more than one run: {mixed}"
    report = count_rows(job.expected, [r["id"] for r in read_committed_rows(str(job.output))])
    assert report.exact, f"{report}\n{job.logs()}"
    return parts


def assert_all_committed(zk: KazooClient, job: Job) -> None:
    """The watermark is at the last batch Spark completed. Not always batches - 1: a driver killed after
    Spark logged a batch's files but before its offsets makes the restart take those files with the next
    one (maxFilesPerTrigger counts only files not yet logged), so the input may take fewer batches."""
    last = max(int(n) for n in os.listdir(job.checkpoint / "commits") if n.isdigit())
    assert watermark(zk, job) == last, f"watermark {watermark(zk, job)}, Spark's last batch {last}\n{job.logs()}"


# -- the cases ----------------------------------------------------------------


def test_driver_killed_mid_batch_restarts_exactly_once(zk, job):
    """Case 4: SIGKILL the driver while an epoch is partly pre-committed; restart; exactly once."""
    job.write_input()
    run = job.start("--slow-ms", str(SLOW_MS))
    epoch, killed_runs, rerun = kill_mid_batch(zk, job, run)

    job.run_to_end()
    parts = assert_exactly_once(job)
    assert_all_committed(zk, job)
    if rerun:  # the re-run epoch is committed from the new run only
        runs = {r for (e, _), r in parts.items() if e == epoch}
        assert runs and not runs & killed_runs, f"epoch {epoch}: committed runs {runs}, killed {killed_runs}"


def test_driver_killed_after_spark_commit_before_coordinator(zk, job):
    """Case 5: commits/0 exists, nobody committed epoch 0, driver dies; a restart commits it once."""
    job.write_input()
    run = job.start("--coordinator", "daemon", "--slow-ms", str(SLOW_MS))
    wait_while_alive("commits/0 in the checkpoint", lambda: spark_completed(job, 0), job, run)
    kill_run(run)

    qp = query_paths(zk, job)
    assert qp is not None, "the killed run registered nothing"
    assert watermark(zk, job) < 0, "epoch 0 committed although no coordinator ran"
    assert (read_json(zk, qp.epoch(0)) or {}).get("state", "open") != "committed"
    assert children(zk, qp.attempts(0)), "epoch 0's pre-commits are missing"
    assert visible_parts(job.output) == {}, "something is visible before any commit"
    assert read_committed_rows(str(job.output)) == []

    job.run_to_end()  # embedded coordinator; epoch 0 is not re-run by Spark
    parts = assert_exactly_once(job)
    assert_all_committed(zk, job)
    assert any(e == 0 for e, _ in parts), "epoch 0 has no committed file"


def test_restart_with_fewer_partitions(zk, job):
    """Case 9: killed mid-batch with 4 partitions, restarted with 2: the re-run epoch's new mapping wins."""
    job.write_input()
    run = job.start("--partitions", "4", "--slow-ms", str(SLOW_MS))
    epoch, killed_runs, rerun = kill_mid_batch(zk, job, run)

    job.run_to_end("--partitions", "2")
    parts = assert_exactly_once(job)
    assert_all_committed(zk, job)
    if rerun:
        redone = {p: r for (e, p), r in parts.items() if e == epoch}
        assert redone and set(redone) <= {0, 1}, f"epoch {epoch} committed partitions {sorted(redone)}"
        assert not set(redone.values()) & killed_runs, f"epoch {epoch} committed a killed run's pre-commit"
    later = {p for (e, p) in parts if e > epoch}
    assert later <= {0, 1}, f"epochs after {epoch} should have 2 partitions, got {sorted(later)}"


def test_run_failing_for_good_leaves_epoch_invisible_and_rerun_commits(zk, job):
    """Case 10: every attempt of one partition of epoch 1 fails; nothing of epoch 1 shows; a rerun redoes it."""
    job.batches = 4
    job.write_input()
    run = job.start(module="tests.driver_job", env={POISON_ENV: "1"})
    rc = wait_exit(run, JOB_TIMEOUT)
    assert rc is not None, f"the poisoned run did not exit\n{job.logs()}"
    assert rc != 0, f"the poisoned run exited 0\n{job.logs()}"
    assert "poisoned" in run.log.read_text(errors="replace"), f"failed for another reason\n{job.logs()}"
    kill_run(run)  # leftovers of the failed driver's tree, if any

    # At most epoch 0 is visible (the driver may have died before committing it), and all of it.
    parts = visible_parts(job.output)
    assert {e for e, _ in parts} <= {0}, f"visible epochs after the failed run: {sorted(parts)}"
    rows = read_committed_rows(str(job.output))
    batches = {r["batch"] for r in rows}
    assert len(batches) <= 1, f"rows of batches {batches} visible after the failed run"
    if rows:
        (batch,) = batches
        want = range(batch * ROWS_PER_BATCH, (batch + 1) * ROWS_PER_BATCH)
        report = count_rows(want, [r["id"] for r in rows])
        assert report.exact, f"epoch 0 visible but not exactly once: {report}"
    assert watermark(zk, job) < POISON_EPOCH
    # The healthy partitions of epoch 1 pre-committed (durable, invisible) before the job was aborted.
    qp = query_paths(zk, job)
    stranded = children(zk, qp.attempts(POISON_EPOCH))
    assert stranded, f"no pre-commit of epoch {POISON_EPOCH} to clean up: the case is not exercised"
    assert set(pending_of_epoch(job, POISON_EPOCH)), "pre-committed files of the failed run are missing"

    job.run_to_end(module="tests.driver_job")
    assert_exactly_once(job)
    assert_all_committed(zk, job)
    record = read_json(zk, qp.epoch(POISON_EPOCH))
    assert record is None or record["state"] == "committed", f"epoch {POISON_EPOCH} record: {record}"
    assert children(zk, qp.attempts(POISON_EPOCH)) == [], "pre-commits of the failed epoch were left behind"
    # The failed run's pre-committed files of epoch 1 were aborted, not just skipped.
    leftovers = pending_of_epoch(job, POISON_EPOCH)
    assert not leftovers, f"pre-committed files of epoch {POISON_EPOCH} never aborted: {leftovers}"
