"""Kafka's producer settings, under Kafka's own names, as LogSink arguments.

Spark's Kafka sink takes producer settings as ``kafka.``-prefixed options (``kafka.linger.ms``,
``kafka.compression.type``, ...). :func:`log_sink_args` translates them, prefix stripped, into
``LogSink`` keyword arguments (``producer=`` for twophase.client.Producer, ``transaction_timeout_ms=``,
``security=``, ``bootstrap=``), parsing and range-checking each string, and refuses what the sink
cannot honour, naming the option as the user wrote it::

    args = log_sink_args({"bootstrap.servers": "kafka:9092", "linger.ms": "20", "compression.type": "zstd"})
    # {"bootstrap": "kafka:9092", "producer": {"linger_ms": 20, "compression": "zstd"}}
    sink = LogSink(topic="orders", columns="kafka", **args)
    log_sink_args({"acks": "1"})   # ValueError: kafka.acks=1: the sink's producer is transactional, ...

It lives with the sink, not the client, because what it refuses is the sink's business: the sink
owns the transactional ids, and the sink (with its settings) is stored in ZooKeeper, so passwords
are refused here and read where each client opens instead (``security="file:..."``/``"env:..."``,
docs/security.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from twophase.client import Producer
from twophase.client.security import SETTINGS as SECURITY_SETTINGS
from twophase.client.security import SECRET_SETTINGS, secrets_in
from twophase.wire.compression import codec_id

_MAX_INT32 = 2**31 - 1
_DEFAULTS = {name: p.default for name, p in inspect.signature(Producer).parameters.items()}


def _int(low: int, high: int = _MAX_INT32, unit: str = "") -> Callable[[str, str], int]:
    def parse(option: str, text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError(f"{option}={text!r} is not a whole number{unit}") from None
        if not low <= number <= high:
            raise ValueError(f"{option}={number} is out of range: {low}..{high}{unit}")
        return number
    return parse


def _compression(option: str, text: str) -> str:
    name = text.strip().lower()
    try:
        codec_id(name)
    except ValueError as e:
        raise ValueError(f"{option}={text!r}: {e}") from None
    return name


def _acks(option: str, text: str) -> str:
    if text.strip().lower() not in ("all", "-1"):
        raise ValueError(f"{option}={text}: the sink's producer is transactional and idempotent, which needs "
                         "acks=all (or -1)")
    return "all"


def _idempotence(option: str, text: str) -> None:
    if text.strip().lower() != "true":
        raise ValueError(f"{option}={text}: the sink's producer is transactional, so always idempotent; "
                         "only true is accepted")


def _retries(option: str, text: str) -> int:
    number = _int(0)(option, text)
    if number == 0:
        raise ValueError(f"{option}=0: the sink's producer is idempotent, which needs retries (Kafka's refuses 0 too)")
    return number


def _text(option: str, text: str) -> str:
    if not text.strip():
        raise ValueError(f"{option} is empty")
    return text.strip()


# Kafka's name -> (LogSink argument, the Producer keyword within ``producer`` if any, parser).
_MS, _BYTES = " of ms", " of bytes"
_SETTINGS: dict[str, tuple[str, str | None, Callable[[str, str], Any]]] = {
    "bootstrap.servers": ("bootstrap", None, _text),
    "linger.ms": ("producer", "linger_ms", _int(0, unit=_MS)),
    "batch.size": ("producer", "batch_size", _int(0, unit=_BYTES)),
    "compression.type": ("producer", "compression", _compression),
    "acks": ("producer", "acks", _acks),
    "retries": ("producer", "retries", _retries),
    "delivery.timeout.ms": ("producer", "delivery_timeout_ms", _int(1, unit=_MS)),
    "request.timeout.ms": ("producer", "request_timeout_ms", _int(1, unit=_MS)),
    "client.id": ("producer", "client_id", _text),
    "buffer.memory": ("producer", "buffer_memory", _int(1, unit=_BYTES)),
    "max.block.ms": ("producer", "max_block_ms", _int(0, unit=_MS)),
    "max.request.size": ("producer", "max_request_size", _int(1, unit=_BYTES)),  # also caps the batch size (below)
    "max.in.flight.requests.per.connection": ("producer", "max_in_flight", _int(1, 5)),  # 5: idempotence's limit
    "enable.idempotence": ("producer", None, _idempotence),
    "transaction.timeout.ms": ("transaction_timeout_ms", None, _int(1, unit=_MS)),
}
# Java clients' security settings with no twophase name: what to give instead ({p}: the caller's prefix).
_JAVA_SECURITY = {
    "ssl.truststore": "the CA certificates as a PEM file: {p}ssl.ca.location",
    "ssl.keystore": "the client certificate and its key as PEM files: {p}ssl.certificate.location and "
                    "{p}ssl.key.location",
    "sasl.jaas.config": "the security settings, password included, as a source: the twophase.security option "
                        "('file:PATH' or 'env:PREFIX')",
}
_REFUSED = {
    "transactional.id": "the sink owns its transactional ids, one per task slot "
                        "(<prefix>.<app>.<query>.<partition>.<slot>; LogSink(transactional_id_prefix=...))",
    "key.serializer": "keys are serialized with ByteArraySerializer (as in Spark's Kafka sink)",
    "value.serializer": "values are serialized with ByteArraySerializer (as in Spark's Kafka sink)",
}


def log_sink_args(props: Mapping[str, str], prefix: str = "kafka.") -> dict[str, Any]:
    """LogSink keyword arguments from Kafka producer settings (names without ``prefix``, string values).

    ValueError naming ``prefix + name`` for a setting that is unknown, refused or out of range. Names
    of Kafka's security settings (``security.protocol``, ``sasl.mechanism``, ``ssl.ca.location``, ...)
    become ``security=`` (twophase.client.security checks them); their passwords (``sasl.password``,
    ``ssl.key.password``, ``sasl.jaas.config``) are refused: the sink is stored in ZooKeeper.
    """
    args: dict[str, Any] = {}
    producer: dict[str, Any] = {}
    security: dict[str, str] = {}
    for name, raw in props.items():
        option = prefix + name
        if not isinstance(raw, str):
            raise ValueError(f"{option} must be a string, not {type(raw).__name__}")
        if name in _REFUSED:
            raise ValueError(f"{option} is not supported: {_REFUSED[name]}")
        if name in SECURITY_SETTINGS:
            security[name] = raw
            continue
        if name.startswith(("ssl.", "sasl.")):
            java = next((instead for start, instead in _JAVA_SECURITY.items() if name.startswith(start)), None)
            hint = f"; give {java.format(p=prefix)}" if java else ""
            raise ValueError(f"{option} is not a security setting twophase supports{hint}; supported: "
                             f"{', '.join(prefix + s for s in SECURITY_SETTINGS if s not in SECRET_SETTINGS)}, and "
                             "passwords through the twophase.security option (docs/security.md)")
        if name not in _SETTINGS:
            raise ValueError(f"{option} is not a producer setting twophase supports; supported: "
                             f"{', '.join(prefix + s for s in (*_SETTINGS, *SECURITY_SETTINGS))}")
        target, keyword, parse = _SETTINGS[name]
        value = parse(option, raw)
        if target != "producer":
            args[target] = value
        elif keyword is not None:
            producer[keyword] = value
    if "max_request_size" in producer:  # a Kafka batch never exceeds a request; nor does ours
        producer["batch_size"] = min(producer.get("batch_size", _DEFAULTS["batch_size"]), producer["max_request_size"])
    if "delivery_timeout_ms" in producer:  # Kafka's own check: a batch may linger, then wait a whole request
        needed = sum(producer.get(k, _DEFAULTS[k]) for k in ("linger_ms", "request_timeout_ms"))
        if producer["delivery_timeout_ms"] < needed:
            raise ValueError(f"{prefix}delivery.timeout.ms={producer['delivery_timeout_ms']} should be at least "
                             f"{prefix}linger.ms + {prefix}request.timeout.ms ({needed})")
    secrets = secrets_in(security)
    if secrets:
        raise ValueError(f"{', '.join(prefix + s for s in secrets)}: a password in the query's options would be "
                         "stored in ZooKeeper with the sink; give the security settings as a source instead, "
                         "the twophase.security option 'file:PATH' or 'env:PREFIX' (docs/security.md)")
    if producer:
        args["producer"] = producer
    if security:
        args["security"] = security
    return args
