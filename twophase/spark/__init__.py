"""Spark integration: ``from twophase.spark import TwoPhaseSink``."""

from twophase.spark.writer import ContinuousProcessingNotSupported, TwoPhaseSink

__all__ = ["ContinuousProcessingNotSupported", "TwoPhaseSink"]
