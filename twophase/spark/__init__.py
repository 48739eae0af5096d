"""Spark integration: ``from twophase.spark import TwoPhaseSink``."""

from twophase.spark.driver import HookFailed
from twophase.spark.writer import ContinuousProcessingNotSupported, TwoPhaseSink
from twophase.supervisor import Supervision
from twophase.task import PhaseTwoHalted

__all__ = ["ContinuousProcessingNotSupported", "HookFailed", "PhaseTwoHalted", "Supervision", "TwoPhaseSink"]
