"""Storage failures that are not Kafka protocol errors (those are in :mod:`twophase.wire.errors`)."""

from __future__ import annotations


class DataDirLockedError(RuntimeError):
    """Another process (or LogManager) already holds the data directory."""
