"""scripts/demo.sh's main job, end to end: Kafka in, enrichment + aggregation, exactly once through chaos.

Runs ``python -m examples.exactly_once_demo --plain`` as the demo script does (its own ZooKeeper,
broker process and Spark driver; task failures, broker kill -9, ZooKeeper restart, driver SIGKILL
between pre-commit and commit) with small sizes, in a temp work dir, and checks its verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

REPO = Path(__file__).resolve().parents[1]
SMALL = ("--rate", "40", "--max-offsets", "200", "--epochs-between-faults", "1", "--timeout", "300")


def test_demo_main_job_is_exactly_once_through_chaos(tmp_path):
    """Exit 0, every fault reported, lost 0 / duplicated 0 and the aggregate equal to the batch computation."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYSPARK_PYTHON": sys.executable}
    done = subprocess.run([sys.executable, "-m", "examples.exactly_once_demo", "--plain",
                           "--workdir", str(tmp_path / "demo"), *SMALL],
                          cwd=REPO, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for fault in ("FAULT kill -9 of the broker", "FAULT ZooKeeper restart", "FAULT SIGKILL of the driver",
                  "task failure:", "the interrupted enrich epoch"):
        assert fault in out, f"{fault!r} not reported\n{out}"
    assert "lost 0, duplicated 0; aggregate exact" in out, out
    assert "enriched rows from aborted input: 0; rows with wrong derived fields: 0" in out, out
    assert "transactions still open on the broker: 0" in out, out
