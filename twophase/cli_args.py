"""argparse types shared by every ``twophase`` command: a bad option value is refused with exit code 2
and a message naming the option, before anything runs.

Usage::

    p.add_argument("--attempts", type=positive_int, default=3)
    p.add_argument("--port", type=int_from(0, 65535), default=9092)
    p.add_argument("--poll-interval", type=positive_seconds, default=2.0)
    p.add_argument("--app", type=app_name, required=True)
    p.add_argument("--host", type=non_empty("an address (0.0.0.0 for every interface)"))

The library checks the same bounds (``CommitPolicy``, ``CoordinatorDaemon``, ``BrokerConfig``), so
Python callers meet the same refusal as a ValueError.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_from(lowest: int, highest: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lowest, highest]."""
    def parse(value: str) -> int:
        n = int(value)
        if n < lowest or (highest is not None and n > highest):
            bounds = f"at least {lowest}" if highest is None else f"between {lowest} and {highest}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {n}")
        return n
    parse.__name__ = "integer"  # argparse names the type in "invalid integer value" errors
    return parse


positive_int = int_from(1)


def check_positive_seconds(value: float, what: str) -> float:
    """``value`` if it is a finite number of seconds > 0, else ValueError naming ``what``.

    Zero or NaN would make a waiting loop spin; infinity would never wake it.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds above 0, not {value!r}")
    return float(value)


def positive_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        return check_positive_seconds(float(value), "it")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, not {value!r}") from None


positive_seconds.__name__ = "seconds"


def check_app_name(name: str) -> str:
    """``name`` if it can name an app (one znode under ``<root>/apps``), else ValueError saying why."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an app name must not be empty, not {name!r}")
    if "/" in name or name in (".", "..") or any(not c.isprintable() for c in name):
        raise ValueError(f"an app name is one znode name: no '/', control characters, '.' or '..', not {name!r}")
    return name


def app_name(value: str) -> str:
    """An argparse type: an app name (see :func:`check_app_name`)."""
    try:
        return check_app_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


app_name.__name__ = "app name"


def non_empty(what: str) -> Callable[[str], str]:
    """An argparse type: a string that is not empty or blank; the refusal says it "must name ``what``"."""
    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"must name {what}")
        return value
    parse.__name__ = "value"
    return parse
