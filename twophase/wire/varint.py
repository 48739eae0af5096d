"""Varints: zigzag-signed inside Kafka records, unsigned in flexible-version message framing.

Example::

    encode_varint(-1)              # b"\\x01"
    decode_varint(b"\\x01", 0)      # (-1, 1): value and the position after it
    decode_uvarint(b"\\x01", 0)     # (1, 1): the same byte, unsigned
"""

from __future__ import annotations


def encode_varint(value: int) -> bytes:
    """Zigzag-encode a signed 64-bit integer."""
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag >= 0x80:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def decode_uvarint(buf: bytes | bytearray | memoryview, pos: int, end: int | None = None) -> tuple[int, int]:
    """Decode the unsigned varint at ``pos`` (before ``end``); returns (value, next position).

    Raises ValueError if it is truncated or longer than 10 bytes.
    """
    end = len(buf) if end is None else end
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def decode_varint(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """Decode the zigzag varint at ``pos``; returns (value, next position). Raises ValueError if truncated."""
    zigzag, pos = decode_uvarint(buf, pos)
    return (zigzag >> 1) ^ -(zigzag & 1), pos
