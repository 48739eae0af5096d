"""Spark integration: ``from twophase.spark import TwoPhaseSink``; ``register(spark)`` adds the
``twophase-kafka`` source (twophase/spark/source.py) to a session."""

from twophase.spark.driver import HookFailed
from twophase.spark.source import register
from twophase.spark.writer import ContinuousProcessingNotSupported, TwoPhaseSink
from twophase.supervisor import Supervision
from twophase.task import PhaseTwoHalted

__all__ = ["ContinuousProcessingNotSupported", "HookFailed", "PhaseTwoHalted", "Supervision", "TwoPhaseSink", "register"]
