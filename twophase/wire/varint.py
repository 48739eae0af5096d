"""Zigzag varints as used inside Kafka records (protobuf-style, signed).

Example::

    encode_varint(-1)              # b"\\x01"
    decode_varint(b"\\x01", 0)      # (-1, 1): value and the position after it
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


def decode_varint(buf: bytes | bytearray | memoryview, pos: int) -> tuple[int, int]:
    """Decode the varint at ``pos``; returns (value, next position). Raises ValueError if truncated."""
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
