"""Spark's Kafka sink columns for LogSink: ``value``, ``key``, ``topic``, ``partition``, ``headers``, ``timestamp``.

A row written with ``LogSink(..., columns="kafka")`` is what ``df.writeStream.format("kafka")`` takes,
with the same rules (Spark's ``KafkaWriter``):

- ``value``: string or binary, required; null is a tombstone (a record without a value).
- ``key``: string or binary, optional; null or absent is a record without a key (the partitioner
  spreads those).
- ``topic``: string. The sink's ``topic`` (Spark's ``topic`` option), if set, is the topic of every
  row and overrides the column, as in Spark; without it every row needs a non-null ``topic``.
- ``partition``: int, optional; null or absent lets the partitioner choose (murmur2 of the key).
- ``headers``: array<struct<key: string, value: binary>>, optional.
- ``timestamp``: timestamp, or double (seconds since the epoch), optional (SPARK-50160); null or
  absent is the time of the write. Milliseconds, as Kafka keeps them; before 1970 is an error.

Other columns are ignored. Strings are written as UTF-8. A schema is checked once, before anything is
written (:func:`validate_kafka_schema`, Spark's messages); :func:`kafka_records` turns an Arrow
batch into producer records a column at a time, :func:`kafka_record` one row (``foreach``)::

    schema = pa.schema([("value", pa.string()), ("topic", pa.string())])
    validate_kafka_schema(schema, default_topic=None)
    validate_kafka_schema([("value", "int")], "out")   # ValueError: value attribute unsupported type int. ...
    kafka_records(batch, "out")            # [(topic, partition, key, value, headers, timestamp_ms), ...]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Union

import pyarrow as pa
import pyarrow.compute as pc

from twophase.client.producer import OutRecord

COLUMNS = ("topic", "key", "value", "headers", "partition", "timestamp")
HEADERS_TYPE = "array<struct<key:string,value:binary>>"
_ALLOWED = {"topic": ("string",), "key": ("string", "binary"), "value": ("string", "binary"),
            "headers": (HEADERS_TYPE,), "partition": ("int",), "timestamp": ("double", "timestamp")}
TOPIC_REQUIRED = ("topic option required when no 'topic' attribute is present. "
                  "Use the topic option for setting a topic.")
NULL_TOPIC = "null topic present in the data. Use the topic option for setting a default topic."
VALUE_REQUIRED = "Required attribute 'value' not found"
NEGATIVE_TIMESTAMP = "timestamp before 1970 present in the data: Kafka's record timestamps are not negative"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)
SchemaLike = Union[pa.Schema, Iterable[tuple[str, Union[pa.DataType, str]]]]

_SIMPLE = {pa.string(): "string", pa.large_string(): "string", pa.binary(): "binary", pa.large_binary(): "binary",
           pa.int8(): "tinyint", pa.int16(): "smallint", pa.int32(): "int", pa.int64(): "bigint",
           pa.float32(): "float", pa.float64(): "double", pa.bool_(): "boolean", pa.date32(): "date",
           pa.null(): "void"}
_AS_BINARY = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(), pa.string_view(): pa.binary_view()}


def catalog_string(arrow_type: pa.DataType) -> str:
    """The Spark SQL name (``catalogString``) of the type Spark maps to ``arrow_type``: ``int`` for
    int32, ``array<struct<key:string,value:binary>>`` for a list of such structs; Arrow's own name
    for a type Spark has no name for."""
    simple = _SIMPLE.get(arrow_type)
    if simple is not None:
        return simple
    if pa.types.is_string_view(arrow_type):
        return "string"
    if pa.types.is_binary_view(arrow_type):
        return "binary"
    if pa.types.is_timestamp(arrow_type):
        return "timestamp" if arrow_type.tz else "timestamp_ntz"
    if pa.types.is_decimal(arrow_type):
        return f"decimal({arrow_type.precision},{arrow_type.scale})"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_list_view(arrow_type):
        return f"array<{catalog_string(arrow_type.value_type)}>"
    if pa.types.is_struct(arrow_type):
        return "struct<" + ",".join(f"{f.name}:{catalog_string(f.type)}" for f in arrow_type) + ">"
    if pa.types.is_map(arrow_type):
        return f"map<{catalog_string(arrow_type.key_type)},{catalog_string(arrow_type.item_type)}>"
    return str(arrow_type)


def validate_kafka_schema(schema: SchemaLike, default_topic: str | None) -> None:
    """Check the columns as Spark's Kafka sink does before writing; ValueError with Spark's message.

    ``schema``: a ``pyarrow.Schema`` (``to_arrow_schema(df.schema)``) or (name, type) pairs, a type
    being an Arrow type or a Spark SQL type name (``"binary"``, ``"int"``, ``HEADERS_TYPE``)::

        validate_kafka_schema([("value", "binary"), ("partition", "bigint")], "out")
        # ValueError: partition attribute unsupported type bigint. partition must be a(n) int
    """
    types: dict[str, str] = {}
    for name, type_ in schema if not isinstance(schema, pa.Schema) else zip(schema.names, schema.types):
        if name not in types:  # Spark takes the first column of a name
            types[name] = catalog_string(type_) if isinstance(type_, pa.DataType) else type_.replace(" ", "").lower()
    if default_topic is None and "topic" not in types:
        raise ValueError(TOPIC_REQUIRED)
    if "value" not in types:
        raise ValueError(VALUE_REQUIRED)
    for name in COLUMNS:
        if name == "topic" and default_topic is not None:
            continue  # the option overrides the column, whatever its type (Spark's KafkaWriter)
        if name in types and types[name] not in _ALLOWED[name]:
            raise ValueError(f"{name} attribute unsupported type {types[name]}. "
                             f"{name} must be a(n) {' or '.join(_ALLOWED[name])}")


def kafka_records(batch: pa.RecordBatch, default_topic: str | None) -> list[OutRecord]:
    """The producer records of a batch of Kafka sink rows (a schema :func:`validate_kafka_schema`
    accepts), built a column at a time: one Python list per column, no object per row beyond the
    record itself (and its headers, where the column is present)."""
    names = batch.schema.names

    def column(name: str) -> Iterable[Any]:
        if name not in names:
            return itertools.repeat(None, batch.num_rows)
        array = batch.column(names.index(name))
        if array.null_count == len(array):
            return itertools.repeat(None, batch.num_rows)
        binary = _AS_BINARY.get(array.type)  # strings are written as their UTF-8 bytes: a cast, no copy
        return (array if binary is None else array.cast(binary)).to_pylist()

    if default_topic is not None:
        topics: Iterable[str] = itertools.repeat(default_topic, batch.num_rows)
    else:
        array = batch.column(names.index("topic"))
        if array.null_count:
            raise ValueError(NULL_TOPIC)
        topics = array.to_pylist()
    headers = column("headers")
    if "headers" in names:
        headers = [None if hs is None else _headers(hs) for hs in headers]
    return list(zip(topics, column("partition"), column("key"), column("value"), headers, _timestamps(batch)))


def _timestamps(batch: pa.RecordBatch) -> Iterable[int | None]:
    """The ``timestamp`` column in ms since the epoch (truncated, as Spark does), None where null or absent."""
    names = batch.schema.names
    array = batch.column(names.index("timestamp")) if "timestamp" in names else None
    if array is None or array.null_count == len(array):
        return itertools.repeat(None, batch.num_rows)
    if pa.types.is_timestamp(array.type):
        ms = array.cast(pa.timestamp("ms", array.type.tz), safe=False).cast(pa.int64())
    else:  # double: seconds
        ms = pc.multiply(array, 1000.0).cast(pa.int64(), safe=False)
    if pc.min(ms).as_py() < 0:
        raise ValueError(NEGATIVE_TIMESTAMP)
    return ms.to_pylist()


def kafka_record(row: Any, default_topic: str | None) -> OutRecord:
    """The producer record of one Kafka sink row: a Spark ``Row`` (``foreach``), a mapping or a
    :class:`twophase.sink.Record`; ValueError with Spark's words for a missing or mistyped column."""
    fields: Mapping[str, Any] = row.asDict(recursive=True) if hasattr(row, "asDict") else row
    if "value" not in fields:
        raise ValueError(VALUE_REQUIRED)
    if default_topic is not None:
        topic = default_topic
    elif "topic" not in fields:
        raise ValueError(TOPIC_REQUIRED)
    else:
        topic = fields["topic"]
        if topic is None:
            raise ValueError(NULL_TOPIC)
        if not isinstance(topic, str):
            raise ValueError(_row_type_error("topic", topic))
    partition = fields.get("partition")
    if partition is not None and (isinstance(partition, bool) or not isinstance(partition, int)):
        raise ValueError(_row_type_error("partition", partition))
    headers = fields.get("headers")
    return (topic, partition, _row_bytes(fields.get("key"), "key"), _row_bytes(fields["value"], "value"),
            None if headers is None else _headers(headers), _row_timestamp(fields.get("timestamp")))


def _row_timestamp(value: Any) -> int | None:
    """ms since the epoch of a ``timestamp`` value: a datetime (naive ones are local time, as PySpark
    hands them over) or seconds (a double column)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        ms = (value.astimezone(timezone.utc) - _EPOCH) // _MS
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        ms = int(value * 1000)
    else:
        raise ValueError(_row_type_error("timestamp", value))
    if ms < 0:
        raise ValueError(NEGATIVE_TIMESTAMP)
    return ms


def _row_bytes(value: Any, name: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):  # PySpark hands binary columns over as bytearray
        return bytes(value)
    raise ValueError(_row_type_error(name, value))


def _headers(headers: Iterable[Any]) -> list[tuple[str, bytes | None]]:
    pairs = []
    for header in headers:
        if header is None:
            raise ValueError(f"a null header: headers must be a(n) {HEADERS_TYPE} without null elements")
        key, value = (header["key"], header["value"]) if isinstance(header, Mapping) else header
        if not isinstance(key, str):
            raise ValueError(f"header key {key!r}: headers must be a(n) {HEADERS_TYPE} with non-null keys")
        if value is not None and not isinstance(value, bytes):
            if not isinstance(value, (bytearray, memoryview)):
                raise ValueError(f"header {key!r} has a value of type {type(value).__name__}: "
                                 f"headers must be a(n) {HEADERS_TYPE}")
            value = bytes(value)
        pairs.append((key, value))
    return pairs


def _row_type_error(name: str, value: Any) -> str:
    return (f"{name} attribute unsupported type {type(value).__name__}. "
            f"{name} must be a(n) {' or '.join(_ALLOWED[name])}")
