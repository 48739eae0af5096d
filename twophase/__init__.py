"""twophase: exactly-once two-phase-commit output for Spark Structured Streaming."""

from twophase.sink import AbortFailed, CommitFailed, TwoPhaseCommitSink, TxnContext

__all__ = ["AbortFailed", "CommitFailed", "TwoPhaseCommitSink", "TxnContext"]
