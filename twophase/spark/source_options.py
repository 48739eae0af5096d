"""The options of the ``twophase-kafka`` source: Spark's Kafka source names, parsed and checked up front.

:func:`parse_options` turns the (case-insensitive, string-valued) options Spark hands a data source
into a :class:`SourceOptions`, or raises :class:`SourceOptionError` naming the option and what is
wrong with it; the source calls it when the DataFrame is defined, so a bad option fails the query at
its start, before any data is read. docs/source.md lists every option and how it compares with
Spark's Kafka source.

Example::

    opts = parse_options({"kafka.bootstrap.servers": "127.0.0.1:9092", "subscribe": "orders"}, streaming=True)
    opts.subscribe, opts.isolation_level       # ("orders",), "read_committed"
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Mapping

from twophase.client import EARLIEST, LATEST
from twophase.client.cluster import parse_bootstrap
from twophase.client.security import SETTINGS as SECURITY_SETTINGS
from twophase.client.security import as_security

log = logging.getLogger("twophase.spark.source")

# Spark's names, as users write them; Spark hands options over lowercased.
_STRATEGIES = ("subscribe", "subscribePattern", "assign")
_KNOWN = ("kafka.bootstrap.servers", *_STRATEGIES, "startingOffsets", "endingOffsets", "maxOffsetsPerTrigger",
          "failOnDataLoss", "includeHeaders", "kafka.isolation.level", "kafkaConsumer.pollTimeoutMs",
          "kafka.client.id", "kafka.request.timeout.ms", "kafka.max.partition.fetch.bytes", "kafka.fetch.max.bytes",
          *(f"kafka.{name}" for name in SECURITY_SETTINGS), "twophase.security")
# Accepted and ignored, logged: Spark users set them, and they mean nothing here (no consumer group is
# joined and no offset is committed to Kafka: the offsets live in Spark's checkpoint, as in Spark).
_IGNORED = ("kafka.group.id", "groupIdPrefix")
# Spark's Kafka source refuses these too: the source manages them itself.
_SPARK_REFUSES = ("kafka.auto.offset.reset", "kafka.enable.auto.commit", "kafka.key.deserializer",
                  "kafka.value.deserializer", "kafka.interceptor.classes")
_CANONICAL = {name.lower(): name for name in (*_KNOWN, *_IGNORED, *_SPARK_REFUSES)}


class SourceOptionError(ValueError):
    """An option of the ``twophase-kafka`` source is unknown, malformed or conflicts with another; the
    message names it."""


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The checked options of one source (plain values, so it pickles to Spark's executors)."""

    bootstrap: str
    subscribe: tuple[str, ...] = ()
    subscribe_pattern: str | None = None
    assign: tuple[tuple[str, int], ...] = ()
    starting: str | dict[str, dict[int, int]] = "latest"   # "earliest", "latest" or {topic: {partition: offset}}
    ending: str | dict[str, dict[int, int]] = "latest"     # batch only
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    include_headers: bool = False
    isolation_level: str = "read_committed"
    poll_timeout_ms: int = 120_000
    client_id: str = "twophase-spark-source"
    request_timeout_ms: int = 30_000
    max_partition_fetch_bytes: int = 1 << 20
    fetch_max_bytes: int = 50 << 20
    # TLS/SASL: Kafka-named settings (kafka.-prefixed options; a password among them stays out of reprs),
    # or a source for load_security (the twophase.security option). Resolved where a client opens.
    security: dict[str, str] | str | None = dataclasses.field(default=None, repr=False)

    def matches(self, topic: str) -> bool:
        """Whether ``topic`` is one this source reads (subscribe, subscribePattern or assign)."""
        if self.subscribe_pattern is not None:
            return re.fullmatch(self.subscribe_pattern, topic) is not None
        return topic in self.subscribe or any(t == topic for t, _ in self.assign)


def parse_options(options: Mapping[str, str], *, streaming: bool | None) -> SourceOptions:
    """The checked options; SourceOptionError naming the first option that is unknown, malformed or
    conflicting. ``streaming`` says whether a stream (endingOffsets refused) or a batch
    (maxOffsetsPerTrigger refused, startingOffsets latest refused, default earliest) reads them; None
    (not known yet, when Spark asks for the schema) checks what does not depend on it."""
    given = {k.lower(): v for k, v in options.items() if k.lower() != "path"}  # Spark's load(path) option
    for key in given:
        name = _CANONICAL.get(key)
        if name is None:
            hint = " (twophase.client cannot honour this Kafka client setting)" if key.startswith("kafka.") else ""
            raise SourceOptionError(f"unknown option {key!r} for the twophase-kafka source{hint}; "
                                    f"see docs/source.md for the options it takes")
        if name in _SPARK_REFUSES:
            raise SourceOptionError(f"option {name!r} is not supported: the source manages it itself "
                                    f"(Spark's Kafka source refuses it too)")
        if name in _IGNORED:
            log.info("option %r ignored: the twophase-kafka source joins no consumer group and commits no "
                     "offsets to Kafka (they live in the query's checkpoint)", name)

    def get(name: str) -> str | None:
        return given.get(name.lower())

    bootstrap = get("kafka.bootstrap.servers")
    if not bootstrap:
        raise SourceOptionError("option 'kafka.bootstrap.servers' is required")
    try:
        parse_bootstrap(bootstrap)
    except ValueError as exc:
        raise SourceOptionError(f"option 'kafka.bootstrap.servers': {exc}") from None
    chosen = [name for name in _STRATEGIES if get(name) is not None]
    if len(chosen) != 1:
        raise SourceOptionError("exactly one of the options 'subscribe', 'subscribePattern', 'assign' is needed, "
                                f"not {len(chosen)}" + (f" ({', '.join(chosen)})" if chosen else ""))
    fields: dict = {"bootstrap": bootstrap}
    if get("subscribe") is not None:
        topics = tuple(t.strip() for t in get("subscribe").split(",") if t.strip())
        if not topics:
            raise SourceOptionError("option 'subscribe' names no topic")
        fields["subscribe"] = topics
    elif get("subscribePattern") is not None:
        pattern = get("subscribePattern")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SourceOptionError(f"option 'subscribePattern': {pattern!r} is not a regular expression: {exc}") \
                from None
        fields["subscribe_pattern"] = pattern
    else:
        fields["assign"] = _assign(get("assign"))
    fields["security"] = _security(given)

    starting = get("startingOffsets")
    if starting is not None:
        fields["starting"] = _offsets("startingOffsets", starting, allow=(EARLIEST, LATEST))
    elif streaming is False:
        fields["starting"] = "earliest"  # Spark's batch default
    if fields.get("starting") == "latest" and streaming is False:
        raise SourceOptionError("option 'startingOffsets': latest is not allowed for a batch query")
    ending = get("endingOffsets")
    if ending is not None:
        if streaming is True:
            raise SourceOptionError("option 'endingOffsets' is for batch queries only")
        fields["ending"] = _offsets("endingOffsets", ending, allow=(LATEST,))
        if fields["ending"] == "earliest":
            raise SourceOptionError("option 'endingOffsets': earliest is not allowed")
    limit = get("maxOffsetsPerTrigger")
    if limit is not None:
        if streaming is False:
            raise SourceOptionError("option 'maxOffsetsPerTrigger' is for streaming queries only")
        fields["max_offsets_per_trigger"] = _positive_int("maxOffsetsPerTrigger", limit)
    for name, field in (("failOnDataLoss", "fail_on_data_loss"), ("includeHeaders", "include_headers")):
        if get(name) is not None:
            fields[field] = _boolean(name, get(name))
    isolation = get("kafka.isolation.level")
    if isolation is not None:
        if isolation not in ("read_committed", "read_uncommitted"):
            raise SourceOptionError(f"option 'kafka.isolation.level' must be read_committed or read_uncommitted, "
                                    f"not {isolation!r}")
        fields["isolation_level"] = isolation
    for name, field in (("kafkaConsumer.pollTimeoutMs", "poll_timeout_ms"),
                        ("kafka.request.timeout.ms", "request_timeout_ms"),
                        ("kafka.max.partition.fetch.bytes", "max_partition_fetch_bytes"),
                        ("kafka.fetch.max.bytes", "fetch_max_bytes")):
        if get(name) is not None:
            fields[field] = _positive_int(name, get(name))
    if get("kafka.client.id"):
        fields["client_id"] = get("kafka.client.id")
    return SourceOptions(**fields)


def _security(given: Mapping[str, str]) -> dict[str, str] | str | None:
    """The TLS/SASL settings of the options: kafka.-prefixed Kafka names, or a twophase.security source."""
    inline = {name: given[f"kafka.{name}"] for name in SECURITY_SETTINGS if f"kafka.{name}" in given}
    source = given.get("twophase.security")
    if source is not None and inline:
        raise SourceOptionError(f"option 'twophase.security' and the options {sorted('kafka.' + n for n in inline)} "
                                "both set TLS/SASL settings: give one")
    security = source if source is not None else inline or None
    try:
        as_security(security)
    except ValueError as exc:
        named = [f"kafka.{name}" for name in inline if name in str(exc)]
        option = "twophase.security" if source is not None else (named or ["kafka.security.protocol"])[0]
        raise SourceOptionError(f"option {option!r}: {exc}") from None
    return security


def _assign(text: str) -> tuple[tuple[str, int], ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceOptionError(f"option 'assign' is not JSON ({exc}): {text!r}; "
                                'expected e.g. {"topicA":[0,1],"topicB":[2,4]}') from None
    if (not isinstance(value, dict) or not value
            or not all(isinstance(ps, list) and all(type(p) is int and p >= 0 for p in ps) for ps in value.values())):
        raise SourceOptionError(f"option 'assign' must map topics to lists of partition numbers, "
                                f'e.g. {{"topicA":[0,1]}}, not {text!r}')
    found = tuple(sorted({(t, p) for t, ps in value.items() for p in ps}))
    if not found:
        raise SourceOptionError(f"option 'assign' names no partition: {text!r}")
    return found


def _offsets(name: str, text: str, allow: tuple[int, ...]) -> str | dict[str, dict[int, int]]:
    """"earliest", "latest" or Spark's JSON {"topic": {"0": 23, "1": -2}} (-2 earliest, -1 latest)."""
    if text.strip().lower() in ("earliest", "latest"):
        return text.strip().lower()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise SourceOptionError(f"option {name!r} must be earliest, latest or JSON such as "
                                f'{{"topicA":{{"0":23,"1":-2}}}}, not {text!r}') from None
    if not isinstance(value, dict) or not value:
        raise SourceOptionError(f"option {name!r} must map topics to {{partition: offset}}, not {text!r}")
    parsed: dict[str, dict[int, int]] = {}
    for topic, partitions in value.items():
        if not isinstance(partitions, dict):
            raise SourceOptionError(f"option {name!r}: topic {topic!r} must map partitions to offsets, not {text!r}")
        for partition, offset in partitions.items():
            if not str(partition).isdigit() or type(offset) is not int or (offset < 0 and offset not in allow):
                special = " or ".join(str(a) for a in allow)
                raise SourceOptionError(f"option {name!r}: {topic}-{partition} -> {offset!r} is not a partition "
                                        f"number mapped to an offset >= 0 (or {special})")
            parsed.setdefault(topic, {})[int(partition)] = offset
    return parsed


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise SourceOptionError(f"option {name!r} must be a whole number above 0, not {text!r}")
    return value


def _boolean(name: str, text: str) -> bool:
    if text.strip().lower() not in ("true", "false"):
        raise SourceOptionError(f"option {name!r} must be true or false, not {text!r}")
    return text.strip().lower() == "true"
