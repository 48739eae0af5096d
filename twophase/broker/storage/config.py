"""Per-log configuration (Kafka's topic-level configs that this broker implements).

Example::

    base = LogConfig(flush=1000)                      # fsync at most once a second
    topic = base.with_overrides({"retention.ms": "3600000", "segment_bytes": 1 << 20})
    topic.flush_interval_ms                           # 1000
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from twophase.wire.errors import InvalidConfigError

MIB = 1024 * 1024
DAY_MS = 24 * 3600 * 1000

# Kafka's topic-config names for the fields we implement; field names are accepted too.
KAFKA_NAMES: dict[str, str] = {
    "segment.bytes": "segment_bytes",
    "index.interval.bytes": "index_interval_bytes",
    "retention.ms": "retention_ms",
    "retention.bytes": "retention_bytes",
    "flush.ms": "flush",
    "max.message.bytes": "max_message_bytes",
}


@dataclass(frozen=True)
class LogConfig:
    """Settings of one partition log; -1 disables a retention limit."""

    segment_bytes: int = 64 * MIB
    index_interval_bytes: int = 4096
    retention_ms: int = 7 * DAY_MS
    retention_bytes: int = -1
    flush: Literal["always"] | int = "always"  # or an fsync interval in ms
    # Kafka's default: 1 MiB of records plus the 12-byte offset/length prefix.
    max_message_bytes: int = MIB + 12
    producer_id_expiration_ms: int = DAY_MS

    def __post_init__(self) -> None:
        # Index entries hold 32-bit positions, so a segment must stay below 2 GiB.
        if not 1024 <= self.segment_bytes <= 2**31 - 1:
            raise InvalidConfigError(f"segment_bytes {self.segment_bytes} out of range [1024, 2^31-1]")
        if self.index_interval_bytes < 0:
            raise InvalidConfigError("index_interval_bytes must be >= 0")
        if self.retention_ms < -1 or self.retention_bytes < -1:
            raise InvalidConfigError("retention limits must be -1 (unlimited) or >= 0")
        interval_ok = isinstance(self.flush, int) and not isinstance(self.flush, bool) and self.flush >= 0
        if self.flush != "always" and not interval_ok:
            raise InvalidConfigError(f"flush must be 'always' or an interval in ms, not {self.flush!r}")
        if self.max_message_bytes < 0:
            raise InvalidConfigError("max_message_bytes must be >= 0")
        if self.producer_id_expiration_ms < 1:
            raise InvalidConfigError("producer_id_expiration_ms must be >= 1")

    @property
    def flush_interval_ms(self) -> int | None:
        """None when every append is fsynced, else the maximum ms between fsyncs."""
        return None if self.flush == "always" else int(self.flush)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> LogConfig:
        """A copy with ``overrides`` applied; keys are field names or Kafka config names."""
        if not overrides:
            return self
        return dataclasses.replace(self, **normalize_overrides(overrides))


def normalize_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Map Kafka names to field names and coerce string values (as CreateTopics sends them)."""
    fields = {f.name for f in dataclasses.fields(LogConfig)}
    result: dict[str, Any] = {}
    for key, value in overrides.items():
        name = KAFKA_NAMES.get(key, key)
        if name not in fields:
            raise InvalidConfigError(f"unsupported topic config {key!r}")
        if name == "flush" and value == "always":
            result[name] = "always"
            continue
        try:
            result[name] = int(value)
        except (TypeError, ValueError):
            raise InvalidConfigError(f"config {key!r}: {value!r} is not an integer") from None
    # Validates values by constructing once.
    dataclasses.replace(LogConfig(), **result)
    return result
