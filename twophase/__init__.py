"""twophase: exactly-once two-phase-commit output for Spark Structured Streaming."""

from twophase.sink import AbortFailed, CommitFailed, CommitOutcomeUnknown, TwoPhaseCommitSink, TxnContext

__all__ = ["AbortFailed", "CommitFailed", "CommitOutcomeUnknown", "TwoPhaseCommitSink", "TxnContext"]
