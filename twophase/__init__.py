"""twophase: exactly-once two-phase-commit output for Spark Structured Streaming."""

from twophase.sink import CommitFailed, TwoPhaseCommitSink, TxnContext

__all__ = ["CommitFailed", "TwoPhaseCommitSink", "TxnContext"]
