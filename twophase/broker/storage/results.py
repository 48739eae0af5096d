"""Small result types shared by the log and the producer state.

Example::

    result = log.append(records, now_ms)
    result.base_offset, result.last_offset, result.duplicate
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AppendResult:
    """Offsets assigned to an append; ``duplicate`` means a retry acknowledged with its original offsets."""

    base_offset: int
    last_offset: int
    log_append_time: int = -1
    duplicate: bool = False


@dataclass(frozen=True)
class TimestampOffset:
    """Answer of a ListOffsets-by-timestamp lookup: the record's offset and its timestamp."""

    offset: int
    timestamp: int
