"""The codec's bounds check agrees with kio on every message the broker speaks, and catches the
length prefixes that would make kio's native reader allocate absurd amounts of memory."""

from __future__ import annotations

import datetime
import io
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.index import load_request_schema, load_response_schema
from kio.serial import entity_reader, entity_writer
from kio.static.primitive import Records, i64Timedelta

from twophase.broker import APIS
from twophase.wire.codec import DecodeFailed, check_entity, decode_request, encode_request, peek_header

from .conftest import MS

st.register_type_strategy(Records, st.binary(max_size=64).map(Records))

# OffsetCommit v2-v4 carry retention_time, kio's only int64-milliseconds timedelta among the
# APIs this broker speaks. kio's default strategy for it reaches the top of the int64 range,
# where kio's own reader overflows converting to microseconds; keep generated values within
# what kio reads back, so the round trip tests this broker's codec, not kio.
_I64_MS_LIMIT = datetime.timedelta(days=106_751_990)
st.register_type_strategy(
    i64Timedelta,
    st.integers(-_I64_MS_LIMIT // MS, _I64_MS_LIMIT // MS).map(lambda ms: datetime.timedelta(milliseconds=ms)))

MESSAGES = [(loader.__name__.split("_")[1], api.key, v, loader)
            for api in APIS for v in range(api.min_version, api.max_version + 1)
            for loader in (load_request_schema, load_response_schema)]


@pytest.mark.parametrize(("kind", "key", "version", "loader"), MESSAGES,
                         ids=[f"{k}-{key}-v{v}" for k, key, v, _ in MESSAGES])
def test_bounds_check_walks_exactly_what_kio_reads(kind, key, version, loader):
    cls = loader(key, version)

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.from_type(cls))
    def roundtrip(message):
        buf = io.BytesIO()
        entity_writer(cls)(buf, message)
        data = buf.getvalue()
        assert check_entity(cls, data) == len(data)
        _, used = entity_reader(cls)(data, 0)
        assert used == len(data)
        # A truncated message is refused or ends earlier; the check never runs past the end.
        if data:
            try:
                assert check_entity(cls, data[:-1]) <= len(data) - 1
            except DecodeFailed:
                pass

    roundtrip()


@pytest.mark.parametrize(("key", "version", "body"), [
    (0, 9, b"\x01" + struct.pack(">hi", -1, 1000) + b"\xff\xff\xff\xff\x0f"),   # compact array 2^35
    (3, 1, struct.pack(">i", 2**31 - 1)),                                         # legacy array 2^31
    (3, 12, b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"),                   # endless varint
    (19, 7, b"\x02" + b"\xff\xff\xff\x7f"),                                       # compact string 2^28
])
def test_absurd_lengths_are_refused_before_kio_sees_them(key, version, body):
    cls = load_request_schema(key, version)
    header = struct.pack(">hhih", key, version, 1, -1) + (b"\x00" if cls.__header_schema__.__flexible__ else b"")
    with pytest.raises(DecodeFailed):
        decode_request(header + body, cls)


def test_request_roundtrip_and_header_peek():
    cls = load_request_schema(18, 3)
    wire = encode_request(7, cls(client_software_name="n", client_software_version="1"), client_id="me")
    frame = wire[4:]
    assert struct.unpack(">i", wire[:4])[0] == len(frame)
    assert peek_header(frame) == (18, 3, 7)
    header, body = decode_request(frame, cls)
    assert (header.client_id, body.client_software_name) == ("me", "n")
    with pytest.raises(DecodeFailed):
        peek_header(frame[:5])
