"""What the driver hook records of a run, and which runs may vouch for their earlier epochs.

A task's ``open`` creates ``runs/<run>`` empty (its creation order is run start order); the
driver hook fills it in once the run wrote through the app. ``in_order`` is the hook's word
that Spark runs it with an execution that writes ``commits/N`` before batch N + 1 starts
(``MicroBatchExecution``). Only then does the run beginning epoch N + 1 prove N complete: an
async progress tracking run begins N + 1 while ``commits/N`` may exist in Spark's memory only
(docs/spark-facts.md).

Usage::

    put_data(client, qp.run(run_id), RunRecord(time.time(), "driver host:123", in_order=True).encode())
    in_order = InOrderRuns(client)
    if in_order.any_of(qp, registry.runs_begun(epoch + 1)):   # a vetted run began N + 1: N is complete
        ...
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kazoo.client import KazooClient

from coordinator.layout import QueryPaths
from coordinator.zk import RecordError, read_object


@dataclass(frozen=True)
class RunRecord:
    """The data of ``runs/<run>``, written by the driver hook once the run wrote through the app."""

    started: float
    driver: str
    in_order: bool = False  # a record without it (an older hook's) vouches for nothing

    def encode(self) -> bytes:
        """The znode payload."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def read(cls, client: KazooClient, path: str) -> RunRecord | None:
        """The record in the znode ``path``; None while it is missing or empty (no hook recorded the run yet).

        RecordError, naming ``path``, if it holds anything :meth:`encode` does not write.
        """
        data = read_object(client, path)
        if data is None:
            return None
        started, driver, in_order = data.get("started"), data.get("driver", ""), data.get("in_order", False)
        if isinstance(started, bool) or not isinstance(started, (int, float)):
            raise RecordError(f"znode {path}: \"started\" {started!r:.40} is not a timestamp")
        if not isinstance(driver, str):
            raise RecordError(f"znode {path}: \"driver\" {driver!r:.40} is not a string")
        if not isinstance(in_order, bool):
            raise RecordError(f"znode {path}: \"in_order\" {in_order!r:.40} is not a boolean")
        return cls(float(started), driver, in_order)


class InOrderRuns:
    """Tells whether any of some runs is one the driver hook recorded as in order, reading each run once.

    A run found in order stays so (the hook never changes a record's ``in_order``); one not recorded
    yet, or refused, is read again when asked again.
    """

    def __init__(self, client: KazooClient) -> None:
        self._client = client
        self._in_order: set[str] = set()  # run node paths found in order

    def any_of(self, paths: QueryPaths, runs: Iterable[str]) -> bool:
        """Whether any of the query's ``runs`` is recorded in order."""
        nodes = [paths.run(run) for run in runs]
        if any(node in self._in_order for node in nodes):
            return True
        for node in nodes:
            record = RunRecord.read(self._client, node)
            if record is not None and record.in_order:
                self._in_order.add(node)
                return True
        return False
