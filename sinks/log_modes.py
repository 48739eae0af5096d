"""How LogSink commits: KIP-939 prepared transactions, or classic flushed ones where the broker has none.

``prepared`` (KIP-939, the built-in broker): pre_commit prepares the transaction; it never times out,
so an epoch whose commit waits for a driver restart or a coordinator failover is still committable.

``classic`` (every Apache Kafka release; no release ships KIP-939): pre_commit flushes an ordinary
transaction opened with the longest timeout the broker allows (its ``transaction.max.timeout.ms``,
read with DescribeConfigs, else Kafka's default of 15 minutes); the coordinator ends it with EndTxn and
the producer id and epoch from the handle, as Flink's Kafka sink does. A commit that comes after the
timeout finds the transaction aborted by the broker: that is CommitFailed (the epoch becomes FAILED),
worded by :func:`aborted_in_words`, never a silent loss.

``auto`` picks ``prepared`` where the broker offers it (InitProducerId v6 and enable2Pc accepted) and
``classic`` otherwise, once per process and bootstrap.

Example::

    modes = BrokerModes()
    modes.known("kafka:9092")                 # None until learnt
    modes.learn("kafka:9092", "classic")      # after a 2PC InitProducerId was refused
    timeout_ms = modes.max_timeout_ms("kafka:9092")
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Literal

from kio.schema.errors import ErrorCode

from twophase.client import Admin, KafkaError
from twophase.client.admin import DEFAULT_MAX_TRANSACTION_TIMEOUT_MS

log = logging.getLogger("twophase.sinks.log")

CommitMode = Literal["auto", "prepared", "classic"]
COMMIT_MODES = ("auto", "prepared", "classic")
# What a broker without KIP-939 answers a 2PC InitProducerId: too old a version, or Kafka 4.1+'s
# refusal while transaction.two.phase.commit.enable is false.
_READ_TTL_S = 600.0      # a timeout read from the broker is used this long
_FALLBACK_TTL_S = 60.0   # Kafka's default, where it could not be read, this long
NO_TWO_PHASE = frozenset({ErrorCode.unsupported_version, ErrorCode.transactional_id_authorization_failed})


class BrokerModes:
    """Per process: the commit mode each bootstrap resolved to, and its broker's longest transaction timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, str] = {}
        self._timeouts: dict[str, tuple[int, float]] = {}  # bootstrap -> (timeout ms, valid until, monotonic)

    def known(self, bootstrap: str) -> str | None:
        """The mode ``auto`` resolved to for ``bootstrap`` in this process, if it has."""
        with self._lock:
            return self._modes.get(bootstrap)

    def learn(self, bootstrap: str, mode: str) -> None:
        """Remember what ``auto`` found for ``bootstrap``."""
        with self._lock:
            if self._modes.get(bootstrap) != mode:
                log.info("broker %s: LogSink commits in %s mode", bootstrap, mode)
            self._modes[bootstrap] = mode

    def max_timeout_ms(self, bootstrap: str, security: str | Mapping[str, str] | None = None) -> int:
        """The broker's ``transaction.max.timeout.ms``, read again after ``_READ_TTL_S`` (an operator may
        raise it); Kafka's default where it cannot be read, tried again after ``_FALLBACK_TTL_S``."""
        now = time.monotonic()
        with self._lock:
            cached = self._timeouts.get(bootstrap)
            if cached is not None and cached[1] > now:
                return cached[0]
        try:
            with Admin(bootstrap, security=security) as admin:
                configs = admin.describe_broker_configs(["transaction.max.timeout.ms"])
            timeout, ttl = int(configs["transaction.max.timeout.ms"]), _READ_TTL_S
        except (KafkaError, KeyError, ValueError) as e:
            log.warning("broker %s: cannot read transaction.max.timeout.ms (%s); using Kafka's default of %d ms "
                        "(set LogSink(transaction_timeout_ms=...) to choose)", bootstrap, e,
                        DEFAULT_MAX_TRANSACTION_TIMEOUT_MS)
            timeout, ttl = DEFAULT_MAX_TRANSACTION_TIMEOUT_MS, _FALLBACK_TTL_S
        with self._lock:
            self._timeouts[bootstrap] = (timeout, now + ttl)
        return timeout


def is_without_two_phase(error: KafkaError) -> bool:
    """True if ``error`` is a broker's way of saying it has no KIP-939 two-phase commit."""
    return error.code in NO_TWO_PHASE


def duration(seconds: float) -> str:
    """``1h 2m 3s``, ``4m 5s``, ``6.1s``: a span for people."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes}m {secs}s" if hours else f"{minutes}m {secs}s"


def aborted_in_words(transactional_id: str, producer: str, records: int, opened_at: float, timeout_ms: int,
                     now: float | None = None) -> str:
    """Why a classic transaction could not be committed, for ``twophase status``: which, how old, which timeout."""
    now = time.time() if now is None else now
    age = max(0.0, now - opened_at)
    opened = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(opened_at))
    head = (f"Kafka transaction {transactional_id} ({producer}, {records} records) was aborted by the broker "
            f"before its commit came: it was opened at {opened}, {duration(age)} ago, ")
    if age * 1000 >= timeout_ms:
        why = (f"longer than its transaction timeout of {duration(timeout_ms / 1000)}, so the broker aborted it "
               "(the driver or the coordinator was down too long)")
    else:
        why = (f"within its transaction timeout of {duration(timeout_ms / 1000)}, so something else ended it "
               "(a new producer with the same transactional id, or an operator's abort)")
    return head + why + "; none of its records is visible. See docs/log-sink.md, 'A FAILED epoch'."
