"""Kafka wire codec on top of kio: frames, request headers, bounds-checked decoding, responses.

kio supplies a dataclass per API message and version, a native reader and a writer. The native
reader trusts length prefixes: an array count of 2^34 from a hostile client makes it try to
allocate the whole array up front and the allocation failure aborts the process. So every
request is first walked by :func:`check_entity`, which follows the same schema (kio's dataclass
fields) without building anything and verifies that each string, byte and array length fits in
the bytes that are left. Only then does kio decode it.

Example::

    api_key, version, correlation_id = peek_header(frame)
    header, request = decode_request(frame, request_type)    # DecodeFailed on bad input
    wire = encode_response(correlation_id, response)         # length-prefixed frame
"""

from __future__ import annotations

import dataclasses
import io
import struct
import types
import typing
from collections.abc import Callable
from typing import Any

from kio.serial import entity_reader, entity_writer

from .varint import decode_uvarint

_HEAD = struct.Struct(">hhi")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")

# Fixed wire sizes of kio's primitive kafka_types.
_FIXED = {
    "bool": 1, "int8": 1, "uint8": 1,
    "int16": 2, "uint16": 2, "error_code": 2,
    "int32": 4, "uint32": 4, "timedelta_i32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "timedelta_i64": 8, "datetime_i64": 8,
    "uuid": 16,
}
_VARIABLE = {"string", "bytes", "records"}


class DecodeFailed(Exception):
    """The request bytes do not match the schema of the API version the header names."""


def peek_header(frame: bytes) -> tuple[int, int, int]:
    """(api_key, api_version, correlation_id): the fixed start of every request header."""
    if len(frame) < _HEAD.size:
        raise DecodeFailed(f"frame of {len(frame)} bytes is shorter than a request header")
    return _HEAD.unpack_from(frame, 0)


# --- bounds check --------------------------------------------------------------------------


def _uvarint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    try:
        return decode_uvarint(buf, pos, end)
    except ValueError as exc:
        raise DecodeFailed(str(exc)) from None


def _length(buf: bytes, pos: int, end: int, compact: bool, wide: bool) -> tuple[int, int]:
    """A length prefix: -1 for null; compact = unsigned varint of length + 1."""
    if compact:
        n, pos = _uvarint(buf, pos, end)
        return n - 1, pos
    size = 4 if wide else 2
    if pos + size > end:
        raise DecodeFailed("truncated length")
    return (_I32 if wide else _I16).unpack_from(buf, pos)[0], pos + size


Step = Callable[[bytes, int, int], int]


def _primitive_step(kafka_type: str, flexible: bool, legacy_string: bool = False,
                    nullable: bool = True) -> tuple[Step, int]:
    """A checker for one primitive value and the minimum number of bytes it takes."""
    if kafka_type in _FIXED:
        size = _FIXED[kafka_type]

        def fixed(buf: bytes, pos: int, end: int) -> int:
            if pos + size > end:
                raise DecodeFailed(f"truncated {kafka_type}")
            return pos + size

        return fixed, size
    if kafka_type in _VARIABLE:
        compact = flexible and not legacy_string
        wide = kafka_type != "string"

        def variable(buf: bytes, pos: int, end: int) -> int:
            n, pos = _length(buf, pos, end, compact, wide)
            if n < -1 or (n == -1 and not nullable):
                raise DecodeFailed(f"{kafka_type} length {n} (null only where the schema allows it)")
            if n > end - pos:
                raise DecodeFailed(f"{kafka_type} length {n} exceeds the {end - pos} bytes left")
            return pos + max(n, 0)

        return variable, (1 if compact else (4 if wide else 2))
    raise DecodeFailed(f"no bounds check for kafka_type {kafka_type!r}")


def _array_step(item: Step, item_min: int, flexible: bool, nullable: bool) -> Step:
    item_min = max(item_min, 1)

    def array(buf: bytes, pos: int, end: int) -> int:
        n, pos = _length(buf, pos, end, flexible, True)
        if n < -1 or (n == -1 and not nullable):
            raise DecodeFailed(f"array length {n} (null only where the schema allows it)")
        if n * item_min > end - pos:
            raise DecodeFailed(f"array of {n} items cannot fit in the {end - pos} bytes left")
        for _ in range(max(n, 0)):
            pos = item(buf, pos, end)
        return pos

    return array


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_plans: dict[type, tuple[Step, int]] = {}


def _entity_plan(cls: type) -> tuple[Step, int]:
    """A checker for an entity of ``cls`` and its minimum wire size (cached per class)."""
    if cls in _plans:
        return _plans[cls]
    flexible = bool(getattr(cls, "__flexible__", False))
    is_header = cls.__name__ == "RequestHeader"
    steps: list[Step] = []
    tagged: dict[int, Step] = {}
    min_size = 1 if flexible else 0  # the tagged-field count
    for field in dataclasses.fields(cls):
        step, size = _field_plan(field, flexible, is_header)
        if "tag" in field.metadata:
            tagged[int(field.metadata["tag"])] = step
        else:
            steps.append(step)
            min_size += size

    def entity(buf: bytes, pos: int, end: int) -> int:
        for step in steps:
            pos = step(buf, pos, end)
        if flexible:
            count, pos = _uvarint(buf, pos, end)
            if count > end - pos:
                raise DecodeFailed(f"{count} tagged fields cannot fit in {end - pos} bytes")
            for _ in range(count):
                tag, pos = _uvarint(buf, pos, end)
                size, pos = _uvarint(buf, pos, end)
                if size > end - pos:
                    raise DecodeFailed(f"tagged field of {size} bytes exceeds the {end - pos} left")
                if tag in tagged:
                    tagged[tag](buf, pos, pos + size)
                pos += size
        return pos

    _plans[cls] = (entity, min_size)
    return _plans[cls]


def _field_plan(field: dataclasses.Field, flexible: bool, is_header: bool) -> tuple[Step, int]:
    # Null where the schema does not allow it is malformed (kio would decode it to None and
    # handlers would trip over it). Tagged fields are left lenient.
    tp, optional = _unwrap_optional(field.type)
    nullable = optional or "tag" in field.metadata
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(inner):
            item, item_min = _entity_plan(inner)
        else:
            item, item_min = _primitive_step(field.metadata["kafka_type"], flexible, nullable=False)
        return _array_step(item, item_min, flexible, nullable), (1 if flexible else 4)
    if dataclasses.is_dataclass(tp):
        step, size = _entity_plan(tp)
        if "tag" in field.metadata or not optional:
            return step, size

        def nullable(buf: bytes, pos: int, end: int) -> int:
            if pos >= end:
                raise DecodeFailed("truncated nullable struct marker")
            marker = buf[pos]
            return pos + 1 if marker == 0xFF else step(buf, pos + 1, end)

        return nullable, 1
    return _primitive_step(field.metadata["kafka_type"], flexible,
                           legacy_string=is_header and field.name == "client_id", nullable=nullable)


def check_entity(cls: type, buf: bytes, pos: int = 0, end: int | None = None) -> int:
    """Walk an encoded ``cls`` at ``pos`` without decoding it; the position after it.

    Raises :class:`DecodeFailed` if any length prefix points past ``end`` or a field the schema
    does not allow to be null is null.
    """
    return _entity_plan(cls)[0](buf, pos, len(buf) if end is None else end)


# --- decode / encode -----------------------------------------------------------------------


def decode_request(frame: bytes, request_type: type) -> tuple[Any, Any]:
    """(header, request) from one frame (without its length prefix). Raises DecodeFailed."""
    header_type = request_type.__header_schema__
    body_start = check_entity(header_type, frame)
    # Trailing bytes are ignored, as Kafka does: librdkafka's Metadata v12 "all topics" request
    # carries three bytes after its tagged fields.
    check_entity(request_type, frame, body_start)
    try:
        header, size = entity_reader(header_type)(frame, 0)
        request, _ = entity_reader(request_type)(frame, size)
    except Exception as exc:  # kio raises its own errors, UnicodeDecodeError, ValueError...
        raise DecodeFailed(f"{type(exc).__name__}: {exc}") from exc
    return header, request


def encode_response(correlation_id: int, response: Any) -> memoryview:
    """The length-prefixed response frame, with the header version the response type names.

    A read-only view of the encoded bytes rather than a copy: a Fetch response is mostly
    record data, and copying it once more would cost as much as encoding it.
    """
    header_type = response.__header_schema__
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    entity_writer(header_type)(buf, header_type(correlation_id=correlation_id))
    entity_writer(type(response))(buf, response)
    data = buf.getbuffer()
    _I32.pack_into(data, 0, len(data) - 4)
    return data.toreadonly()


def encode_request(correlation_id: int, request: Any, client_id: str | None = "twophase") -> bytes:
    """A length-prefixed request frame (the client's, and tests')."""
    header_type = request.__header_schema__
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    entity_writer(header_type)(buf, header_type(
        request_api_key=request.__api_key__, request_api_version=request.__version__,
        correlation_id=correlation_id, client_id=client_id))
    entity_writer(type(request))(buf, request)
    data = buf.getbuffer()
    _I32.pack_into(data, 0, len(data) - 4)
    del data
    return buf.getvalue()


# --- building version-specific messages ----------------------------------------------------

_field_names: dict[type, frozenset[str]] = {}


def build(cls: type, **values: Any) -> Any:
    """``cls(**values)`` keeping only the fields this version of the message has.

    Handlers describe a response once, with every field any version knows, and let each
    version take what it has; fields a version lacks are dropped, missing ones use defaults.
    """
    names = _field_names.get(cls)
    if names is None:
        names = _field_names[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return cls(**{k: v for k, v in values.items() if k in names})


def nested(message_type: type, name: str) -> type:
    """The nested entity class ``name`` from the module that defines ``message_type``."""
    return getattr(__import__(message_type.__module__, fromlist=[name]), name)
