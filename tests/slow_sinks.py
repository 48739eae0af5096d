"""Sinks for tests whose coordinator runs in another process (importable there by module path)."""

from __future__ import annotations

import time

from sinks.files import FileSink


class SlowCommitFileSink(FileSink):
    """A FileSink whose commits take a while, so a coordinator can be killed mid-epoch."""

    commit_concurrency = 1  # one at a time, so "mid-epoch" lasts long enough to land a kill in

    def __init__(self, path: str, commit_seconds: float) -> None:
        super().__init__(path)
        self.commit_seconds = commit_seconds

    def commit(self, handle) -> None:
        time.sleep(self.commit_seconds)
        super().commit(handle)
