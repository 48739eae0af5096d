"""CPU seconds per kind of process over timed regions: where a run's time goes, steadier than wall time.

Every process of this bench is a descendant of it: Spark's JVM, its Python workers (forked by
``pyspark.daemon``), the private ZooKeeper and PostgreSQL servers, a broker subprocess. Their CPU
(user + system, from psutil) is read before and after each region; a process that ends inside a
region loses what it used there (Spark keeps its workers for the whole session)::

    meter = CpuMeter()
    with meter.measure("plain"):
        run_plain()
    print("\\n".join(meter.table(["plain"])))
"""

from __future__ import annotations

import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psutil

DRIVER = "driver (this Python)"


def kind_of(process: psutil.Process) -> str:
    """What a process of the bench is, by its command line."""
    if process.pid == os.getpid():
        return DRIVER
    try:
        cmdline = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "other"
    if "zookeeper" in cmdline.lower() and "java" in cmdline:
        return "ZooKeeper"
    if "java" in cmdline:
        return "Spark JVM"
    if "postgres" in cmdline:
        return "PostgreSQL"
    if "python" in cmdline:
        return "Spark Python workers" if "pyspark" in cmdline or "daemon" in cmdline else "other Python"
    return "other"


def snapshot() -> dict[int, tuple[str, float]]:
    """Per live process of the bench (this one and its descendants): its kind and CPU seconds so far."""
    me = psutil.Process()
    seen = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        seen[process.pid] = (kind_of(process), times.user + times.system)
    return seen


class CpuMeter:
    """CPU seconds by process kind, per labelled region (one list entry per region measured)."""

    def __init__(self) -> None:
        self.runs: dict[str, list[Counter[str]]] = defaultdict(list)

    @contextmanager
    def measure(self, label: str) -> Iterator[None]:
        """Add the CPU every process used during the ``with`` block as one run of ``label``."""
        before = snapshot()
        yield
        used: Counter[str] = Counter()
        for pid, (kind, seconds) in snapshot().items():
            used[kind] += seconds - before.get(pid, (kind, 0.0))[1]
        self.runs[label].append(used)

    def mean(self, label: str) -> Counter[str]:
        """Mean CPU seconds per run of ``label``, by kind."""
        runs = self.runs[label]
        kinds = {kind for run in runs for kind in run}
        return Counter({kind: statistics.mean(run.get(kind, 0.0) for run in runs) for kind in kinds})

    def table(self, labels: Sequence[str], baseline: str | None = None) -> list[str]:
        """Lines of a table: mean CPU seconds per run by kind for each label, and each label's difference
        to ``baseline`` (the cost of what that label adds to it)."""
        means = {label: self.mean(label) for label in labels}
        kinds = sorted({kind for m in means.values() for kind in m}, key=lambda k: -max(m[k] for m in means.values()))
        others = [label for label in labels if baseline and label != baseline]
        width = max(15, *(len(label) + 3 for label in labels))  # room for a "+" and two spaces
        head = f"{'CPU s per run':<24}" + "".join(f"{label:>{width}}" for label in labels)
        head += "".join(f"{'+' + label:>{width}}" for label in others)
        lines = [head, "-" * len(head)]
        for kind in kinds + ["total"]:
            row = {label: (sum(m.values()) if kind == "total" else m[kind]) for label, m in means.items()}
            line = f"{kind:<24}" + "".join(f"{row[label]:>{width}.2f}" for label in labels)
            line += "".join(f"{row[label] - row[baseline]:>+{width}.2f}" for label in others)
            lines.append(line)
        return lines
