"""RecordBatch v2 header parsing, validation, offset rewriting, control batches, and the checks of
the records themselves."""

from __future__ import annotations

import gzip
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kafka.record import MemoryRecords
from kafka.record.default_records import DefaultRecordBatchBuilder as KafkaPythonBuilder

from tests.adversarial.crafted import GZIP, raw_batch, record
from twophase.wire.errors import (
    CorruptRecordError,
    InvalidRecordError,
    MessageTooLargeError,
)
from twophase.wire.records import (
    check_batch_records,
    control_batch,
    decode_batch_records,
    inflate_batch,
    iter_batches,
    iter_record_timestamps,
    parse_control_record,
    parse_header,
    record_batch,
    seal_batch,
    set_base_offset,
    unsealed_batch,
    validate_batch,
)
from twophase.wire.compression import CODEC_NAMES
from twophase.wire.varint import decode_varint, encode_varint

from .batches import batch, decode, kafka_batch


def test_header_fields():
    data = batch([b"a", b"b", b"c"], timestamp=5000, producer_id=42, producer_epoch=3, base_sequence=10,
                 transactional=True)
    h = validate_batch(data)
    assert (h.base_offset, h.magic, h.record_count, h.last_offset_delta) == (0, 2, 3, 2)
    assert (h.base_timestamp, h.max_timestamp) == (5000, 5002)
    assert (h.producer_id, h.producer_epoch, h.base_sequence, h.last_sequence) == (42, 3, 10, 12)
    assert h.is_transactional and not h.is_control
    assert h.size == len(data) and h.last_offset == 2


def test_header_matches_kafka_python_builder():
    data = kafka_batch([b"x"] * 4, producer_id=9, producer_epoch=1, base_sequence=0)
    h = validate_batch(data)
    assert (h.record_count, h.producer_id, h.base_sequence, h.size) == (4, 9, 0, len(data))


def test_iter_batches_several():
    data = batch([b"a"]) + batch([b"b", b"c"]) + kafka_batch([b"d" * 500], compression=1)
    found = list(iter_batches(data))
    assert [h.record_count for _, h in found] == [1, 2, 1]
    assert found[1][0] == len(batch([b"a"]))
    assert found[2][1].compression == 1


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d[:8], "truncated"),
        (lambda d: d[:30], "exceeds"),
        (lambda d: d[:-1], "exceeds"),
        (lambda d: d[:16] + b"\x01" + d[17:], "magic"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]), "CRC"),
        (lambda d: d[:8] + struct.pack(">i", 10) + d[12:], "shorter"),
        (lambda d: d[:8] + struct.pack(">i", -5) + d[12:], "shorter"),
        (lambda d: d[:8] + struct.pack(">i", 2**31 - 1) + d[12:], "exceeds"),
    ],
)
def test_validation_errors(mutate, reason):
    bad = mutate(batch([b"hello", b"world"]))
    with pytest.raises(CorruptRecordError) as info:
        list(iter_batches(bad))
    assert reason in str(info.value)
    assert info.value.code == 2


def test_error_reports_position_of_second_batch():
    first = batch([b"a"])
    with pytest.raises(CorruptRecordError) as info:
        list(iter_batches(first + b"\x00" * 20))
    assert info.value.position == len(first)


def test_set_base_offset_keeps_crc_valid():
    data = bytearray(batch([b"a", b"b"]))
    set_base_offset(data, 0, 1234, leader_epoch=7)
    h = validate_batch(data)
    assert (h.base_offset, h.leader_epoch, h.last_offset) == (1234, 7, 1235)
    assert [r[0] for r in decode(bytes(data))] == [1234, 1235]


@pytest.mark.parametrize("commit", [True, False])
def test_control_batch(commit):
    data = control_batch(producer_id=77, producer_epoch=4, commit=commit, coordinator_epoch=12, timestamp_ms=999)
    h = validate_batch(data)
    assert h.is_control and h.is_transactional and h.record_count == 1
    assert (h.producer_id, h.producer_epoch, h.base_sequence, h.max_timestamp) == (77, 4, -1, 999)
    marker = parse_control_record(data)
    assert (marker.commit, marker.coordinator_epoch) == (commit, 12)
    # An independent decoder agrees.
    kb = MemoryRecords(data).next_batch()
    assert kb.validate_crc() and kb.is_control_batch
    (record,) = list(kb)
    assert record.type == (1 if commit else 0)


def test_parse_control_record_rejects_data_batch():
    with pytest.raises(CorruptRecordError):
        parse_control_record(batch([b"a"]))


def test_record_timestamps_uncompressed_and_compressed():
    data = batch([b"a", b"b", b"c"], timestamps=[50, 20, 70])
    assert list(iter_record_timestamps(data)) == [(0, 50), (1, 20), (2, 70)]
    with pytest.raises(ValueError):
        list(iter_record_timestamps(kafka_batch([b"a" * 500], compression=1)))


def test_parse_header_needs_61_bytes():
    with pytest.raises(CorruptRecordError):
        parse_header(b"\x00" * 60)


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_varint_round_trip(value):
    encoded = encode_varint(value)
    assert decode_varint(encoded + b"junk", 0) == (value, len(encoded))


def _record_body(*fields: bytes) -> bytes:
    body = b"".join(fields)
    return encode_varint(len(body)) + body


@pytest.mark.parametrize("records", [
    _record_body(b"\x00", encode_varint(0), encode_varint(0), encode_varint(2**63 - 40), b"xx"),  # wraps a C length
    _record_body(b"\x00", encode_varint(0), encode_varint(0), encode_varint(2**62), b"xx"),
    _record_body(b"\x00", encode_varint(0), encode_varint(0), encode_varint(-1), encode_varint(-1), encode_varint(5)),
    _record_body(b"\x00", encode_varint(0), encode_varint(0), encode_varint(-1), encode_varint(-1), encode_varint(1),
                 encode_varint(2), b"\xff\xfe", encode_varint(-1)),  # a header key that is not UTF-8
    encode_varint(-3) + b"\x00",
    b"\xff\xff",
    b"",
], ids=["length-2^63", "length-2^62", "headers-past-end", "header-key-not-utf8", "negative-length",
        "truncated-varint", "no-records"])
def test_records_that_do_not_parse_are_invalid_not_a_crash(records):
    with pytest.raises(InvalidRecordError):
        check_batch_records(raw_batch(records, count=1))


def test_gzip_inflation_is_bounded_and_checked():
    body = record(0, b"v" * 5000)
    data = raw_batch(gzip.compress(body[:3000]) + gzip.compress(body[3000:]), count=1, codec=GZIP)  # two members
    assert [r.value for r in decode_batch_records(data)] == [b"v" * 5000]
    with pytest.raises(MessageTooLargeError):
        inflate_batch(data, max_inflated_bytes=4999)
    assert len(inflate_batch(data, max_inflated_bytes=len(body))) == 61 + len(body)
    with pytest.raises(CorruptRecordError, match="truncated"):
        inflate_batch(raw_batch(gzip.compress(body)[:-20], count=1, codec=GZIP))


_records = st.lists(st.tuples(
    st.integers(min_value=0, max_value=2**48),                   # timestamps, in any order (producers refuse < 0)
    st.one_of(st.none(), st.binary(max_size=40)),                # key
    st.one_of(st.none(), st.binary(max_size=200)),               # value
    st.lists(st.tuples(st.text(max_size=8), st.one_of(st.none(), st.binary(max_size=20))), max_size=3)),
    min_size=1, max_size=30)


@given(_records, st.booleans(), st.integers(min_value=-1, max_value=2**31 - 1))
def test_record_batch_is_byte_for_byte_kafka_pythons(records, transactional, base_sequence):
    """record_batch (aiokafka's C builder) against kafka-python's pure-Python builder, an independent one."""
    reference = KafkaPythonBuilder(2, 0, int(transactional), 7, 3, base_sequence, 1 << 40)
    for offset, (timestamp, key, value, headers) in enumerate(records):
        reference.append(offset, timestamp, key, value, headers)
    built = record_batch(records, producer_id=7, producer_epoch=3, base_sequence=base_sequence,
                         transactional=transactional)
    expected = bytearray(reference.build())
    expected[12:16] = b"\xff" * 4  # a producer leaves the partition leader epoch -1 (kafka-python: 0); not in the CRC
    assert built == bytes(expected)


def test_record_batch_takes_header_values_of_any_bytes_like_type():
    plain = record_batch([(1, b"k", b"v", [("h", b"x"), ("n", None)])])
    assert record_batch([(1, b"k", b"v", (["h", bytearray(b"x")], ("n", None)))]) == plain
    assert record_batch([(1, b"k", b"v", [("h", memoryview(b"x")), ("n", None)])]) == plain


@given(_records, st.booleans(), st.integers(min_value=-1, max_value=2**31 - 1))
def test_a_batch_sealed_again_keeps_nothing_of_its_first_seal(records, transactional, base_sequence):
    """A producer encodes a batch ahead and seals it when it sends it, again after a producer id reset:
    the last seal is kafka-python's batch byte for byte."""
    reference = KafkaPythonBuilder(2, 0, int(transactional), 7, 3, base_sequence, 1 << 40)
    for offset, (timestamp, key, value, headers) in enumerate(records):
        reference.append(offset, timestamp, key, value, headers)
    expected = bytearray(reference.build())
    expected[12:16] = b"\xff" * 4  # the partition leader epoch, as in the test above
    unsealed = unsealed_batch(records)
    seal_batch(unsealed, producer_id=99, producer_epoch=9, base_sequence=5, transactional=not transactional)
    assert seal_batch(unsealed, producer_id=7, producer_epoch=3, base_sequence=base_sequence,
                      transactional=transactional) == bytes(expected)


@pytest.mark.parametrize("codec", sorted(CODEC_NAMES.values()))
@pytest.mark.parametrize("transactional", [False, True])
def test_a_compressed_batch_sealed_again_carries_the_last_seal_and_its_codec(codec, transactional):
    records = [(1_700_000_000_000 + i, b"k%d" % i, b"v" * i, [("h", b"x")]) for i in range(20)]
    unsealed = unsealed_batch(records, codec)
    seal_batch(unsealed, producer_id=99, producer_epoch=9, base_sequence=5, transactional=not transactional)
    sealed = seal_batch(unsealed, producer_id=7, producer_epoch=3, base_sequence=40, transactional=transactional)
    header = validate_batch(sealed)  # the CRC is the last seal's
    assert (header.producer_id, header.producer_epoch, header.base_sequence) == (7, 3, 40)
    assert (header.compression, header.is_transactional) == (codec, transactional)
    assert [(r.timestamp_ms, r.key, r.value, r.headers) for r in decode_batch_records(sealed)] == [
        (t, k, v, tuple(h)) for t, k, v, h in records]
    assert sealed == record_batch(records, producer_id=7, producer_epoch=3, base_sequence=40,
                                  transactional=transactional, compression=codec)
