"""Waiting for phase two: block until a query's committed watermark reaches an epoch.

Usage::

    await_watermark(client, app_paths.query(qid).watermark, target=7, timeout=60, app="orders")
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

from coordinator.zk import read_json


def await_watermark(client: KazooClient, watermark: str, target: int, timeout: float, app: str,
                    failure: Callable[[], BaseException | None] = lambda: None) -> int:
    """Return ``target`` once the watermark znode reaches it; TimeoutError after ``timeout``.

    ``failure`` is polled while waiting: a hook that stopped for good raises its error at
    once instead of letting the caller wait out the timeout.
    """
    reached = threading.Event()
    done = threading.Event()  # the watch unregisters at its next call once the wait is over

    def on_change(data: bytes | None, _stat) -> bool:
        if data and json.loads(data)["epoch"] >= target:
            reached.set()
        return not (reached.is_set() or done.is_set())

    DataWatch(client, watermark, on_change)
    deadline = time.monotonic() + timeout
    try:
        while not reached.wait(max(0.0, min(0.5, deadline - time.monotonic()))):
            error = failure()
            if error is not None:
                raise error
            if time.monotonic() >= deadline:
                current = read_json(client, watermark, {"epoch": -1})["epoch"]
                raise TimeoutError(f"app {app}: epoch {target} not committed after {timeout}s "
                                   f"(watermark {current}); see `twophase status`")
    finally:
        done.set()
    return target
