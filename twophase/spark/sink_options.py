"""The exactly-once options of twophase's Spark writers, checked before any row is written.

Both batch-path writers (``format("twophase-kafka")`` and ``format("twophase")``, the one
``write_stream`` configures) take these next to their own options; Spark hands them over as strings
with case-insensitive names:

- ``twophase.zk`` (required): the ZooKeeper connection string;
- ``twophase.app`` (required): the app whose state, coordinator and recovery CLI the query uses;
- ``twophase.root``: the znode under which twophase's state lives (default ``/twophase``);
- ``twophase.coordinator``: ``embedded`` (phase two runs in the driver, the default) or ``daemon``.

The signing secret comes from where :func:`twophase.signing.load_secret` finds it (``TWOPHASE_SECRET``,
``TWOPHASE_SECRET_FILE``, ``~/.config/twophase/secret``), never from an option: options show in Spark's
plans and logs.

Example::

    eo = exactly_once({"twophase.zk": "127.0.0.1:2181", "twophase.app": "orders"})
    eo.app, eo.coordinator            # "orders", "embedded"
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator.layout import DEFAULT_ROOT
from twophase.sink import TwoPhaseCommitSink

APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
COORDINATOR_MODES = ("embedded", "daemon")
EXACTLY_ONCE = ("twophase.zk", "twophase.app", "twophase.root", "twophase.coordinator")
# What Spark itself puts among a sink's options (DataStreamWriter.option("checkpointLocation"), save(path)).
SPARK_OWN = ("checkpointLocation", "path")


class WriterOptionError(ValueError):
    """An option of a twophase writer is missing, unknown or malformed; the message names it."""


def check_app_settings(app: str, root: str, coordinator: str) -> None:
    """ValueError naming what is wrong with an app name, a root znode or a coordinator mode."""
    if not isinstance(app, str) or not APP_NAME.match(app):
        raise ValueError(f"app {app!r}: use letters, digits, '_', '.', '-' (at most 128)")
    if coordinator not in COORDINATOR_MODES:
        raise ValueError(f"coordinator must be one of {COORDINATOR_MODES}, got {coordinator!r}")
    if not root.startswith("/") or root.endswith("/"):
        raise ValueError(f"root {root!r} must be an absolute znode path without a trailing '/'")


def check_sink(sink: object, *, takes_rows: bool) -> None:
    """TypeError unless ``sink`` is a TwoPhaseCommitSink the writer can hand its rows: a writer that hands
    over rows (``foreach``, ``write_stream``: ``takes_rows``) refuses one that takes whole DataFrames."""
    if not isinstance(sink, TwoPhaseCommitSink):
        raise TypeError(f"sink must be a TwoPhaseCommitSink, got {type(sink).__name__}")
    if takes_rows and sink.takes_dataframe:
        raise TypeError(f"{type(sink).__name__} takes a whole DataFrame per micro-batch, written by Spark itself: "
                        "use it with TwoPhaseBatchSink in foreachBatch")


@dataclass(frozen=True)
class ExactlyOnce:
    """Where a writer's two-phase state lives (plain values: it pickles to Spark's executors)."""

    zk: str
    app: str
    root: str = DEFAULT_ROOT
    coordinator: str = "embedded"


def lowered(options: Mapping[str, str]) -> dict[str, str]:
    """Spark's options under lower-case names (Spark matches them case-insensitively)."""
    return {key.lower(): value for key, value in options.items()}


def exactly_once(options: Mapping[str, str], also: Iterable[str] = ()) -> ExactlyOnce:
    """The ``twophase.*`` options; WriterOptionError naming a missing, malformed or unknown one (``also``:
    the writer's own ``twophase.*`` options, which it checks itself)."""
    given, also = lowered(options), tuple(also)
    known = {name.lower() for name in (*EXACTLY_ONCE, *also)}
    unknown = sorted(key for key in given if key.startswith("twophase.") and key not in known)
    if unknown:
        raise WriterOptionError(f"unknown option(s) {unknown}; the writer's twophase options are "
                                f"{[*EXACTLY_ONCE, *also]}")
    for required in ("twophase.zk", "twophase.app"):
        if not given.get(required):
            raise WriterOptionError(f"option {required!r} is required: the exactly-once writers keep their "
                                    "two-phase state in ZooKeeper under an app (docs/spark-writer.md)")
    settings = ExactlyOnce(given["twophase.zk"], given["twophase.app"],
                           given.get("twophase.root", DEFAULT_ROOT), given.get("twophase.coordinator", "embedded"))
    try:
        check_app_settings(settings.app, settings.root, settings.coordinator)
    except ValueError as e:
        raise WriterOptionError(f"option twophase.{str(e)}") from None
    return settings

