"""twophase.wire.compression: each codec round-trips, inflates within its bound, refuses what does not
inflate, and writes the framing Kafka's readers take (snappy-java framing, independent LZ4 blocks)."""

from __future__ import annotations

import struct
import tracemalloc

import cramjam
import lz4.frame
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.codec import snappy_decode

from tests.adversarial.crafted import SNAPPY, raw_batch, record, snappy_declaring, zstd_rle_block
from twophase.wire.compression import (
    CODEC_NAMES,
    COMPRESSION_LZ4,
    COMPRESSION_ZSTD,
    codec_id,
    compress,
    inflate,
    most_inflated,
)
from twophase.wire.errors import CorruptRecordError, MessageTooLargeError
from twophase.wire.records import decode_batch_records, inflate_batch

CODECS = {name: id_ for name, id_ in CODEC_NAMES.items() if name != "none"}
MIB = 1 << 20
BODY = b"".join(record(i, b"value %d " % i * 40) for i in range(200))


@pytest.mark.parametrize("name", list(CODECS))
def test_records_round_trip_and_inflation_is_bounded_and_checked(name):
    codec = CODECS[name]
    payload = compress(codec, BODY)
    data = raw_batch(payload, count=200, codec=codec)
    assert [r.value for r in decode_batch_records(data)] == [b"value %d " % i * 40 for i in range(200)]
    assert len(inflate_batch(data, max_inflated_bytes=len(BODY))) == 61 + len(BODY)
    with pytest.raises(MessageTooLargeError, match=f"more than {len(BODY) - 1} bytes"):
        inflate_batch(data, max_inflated_bytes=len(BODY) - 1)
    with pytest.raises(CorruptRecordError, match=name):
        inflate_batch(raw_batch(payload[: len(payload) // 2], count=200, codec=codec))


@pytest.mark.parametrize("codec", [COMPRESSION_LZ4, COMPRESSION_ZSTD])
def test_frames_larger_than_the_first_buffer_tried_inflate(codec):
    """lz4 and zstd inflate into a guessed buffer and a larger one when it is full: a batch that
    compresses 1000-fold goes through several, and a full buffer is not mistaken for damage."""
    data = bytes(range(256)) * (20 * MIB // 256)
    assert bytes(inflate(codec, b"head", compress(codec, data), max_bytes=len(data))) == b"head" + data


def test_snappy_reads_raw_and_snappy_java_framing_and_writes_the_framing_kafka_python_reads():
    raw = bytes(cramjam.snappy.compress_raw(BODY))
    assert bytes(inflate(SNAPPY, b"", raw, max_bytes=len(BODY))) == BODY
    framed = compress(SNAPPY, BODY * 10)
    assert framed[:16] == b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1)
    first_block = struct.unpack_from(">i", framed, 16)[0]
    assert cramjam.snappy.decompress_raw_len(framed[20 : 20 + first_block]) == 32 << 10  # snappy-java's blocks
    assert snappy_decode(framed) == BODY * 10
    assert bytes(inflate(SNAPPY, b"", framed, max_bytes=len(BODY) * 10)) == BODY * 10


@pytest.mark.parametrize("payload, reason", [
    (b"\x82SNAPPY\x00\x00\x00\x00\x01", "truncated snappy-java header"),
    (b"\x82SNAPPY\x00" + struct.pack(">iii", 1, 1, 100) + b"x" * 10, "of 100 bytes exceeds the 10 present"),
    (b"\x82SNAPPY\x00" + struct.pack(">ii", 1, 1) + b"\x00\x00", "truncated snappy-java block length"),
    (snappy_declaring(10_000), "declares 10000 bytes"),
    (b"\x0a\xff\xff\xff", "bad snappy data"),
], ids=["short-header", "block-past-end", "short-block-length", "declares-more-than-it-holds", "garbage"])
def test_snappy_that_does_not_inflate_is_corrupt(payload, reason):
    with pytest.raises(CorruptRecordError, match=reason):
        inflate(SNAPPY, b"", payload, max_bytes=MIB)


def test_snappy_declaring_more_than_the_bound_is_refused_before_allocating():
    tracemalloc.start()
    try:
        with pytest.raises(MessageTooLargeError):
            inflate(SNAPPY, b"", snappy_declaring(1 << 30), max_bytes=MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB


def test_lz4_frames_have_independent_64_kib_blocks_and_a_valid_header_checksum():
    """What Kafka's Java reader (Lz4BlockInputStream) requires: version 1, independent blocks, a
    64 KiB..4 MiB block size and a correct header checksum (python-lz4 checks it)."""
    framed = compress(COMPRESSION_LZ4, BODY * 50)
    info = lz4.frame.get_frame_info(framed)
    assert not info["block_linked"] and info["block_size_id"] == 4 and not info["content_checksum"]
    assert lz4.frame.decompress(framed) == BODY * 50


def test_zstd_frame_declaring_a_size_it_does_not_hold_is_corrupt():
    """A frame's declared content size is not trusted: 1 GiB declared, 10 bytes held."""
    header = struct.pack("<I", 0xFD2FB528) + bytes([0b11_1_0_0_0_00]) + struct.pack("<Q", 1 << 30)
    with pytest.raises(CorruptRecordError, match="zstd"):
        inflate(COMPRESSION_ZSTD, b"", header + zstd_rle_block(10, last=True), max_bytes=64 * MIB)


def test_codec_names_and_ids():
    assert [codec_id(name) for name in ("none", "gzip", "snappy", "lz4", "zstd")] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="unknown compression codec 'brotli': one of none, gzip, snappy, lz4, zstd"):
        codec_id("brotli")
    with pytest.raises(CorruptRecordError, match="unknown compression codec 6"):
        inflate(6, b"", b"data", max_bytes=MIB)
    assert most_inflated(6, 100) == 0 and most_inflated(COMPRESSION_LZ4, 100) == 25_500


@settings(max_examples=400, deadline=None)
@given(codec=st.sampled_from(list(CODECS.values())), cut=st.integers(0, 10_000),
       damage=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=5))
def test_damaged_data_of_any_codec_is_refused_with_a_record_error(codec, cut, damage):
    """Cut short or with bytes changed: inflating raises CorruptRecordError or MessageTooLargeError (or
    the change was harmless), never another exception from the codec library."""
    data = bytearray(compress(codec, BODY))
    if cut < len(data):
        del data[cut:]
    for at, value in damage:
        if data:
            data[at % len(data)] = value
    try:
        inflate(codec, b"", bytes(data), max_bytes=MIB)
    except (CorruptRecordError, MessageTooLargeError):
        pass
