"""Bad input closes the offending connection (or gets an error response); the broker keeps serving
every other client."""

from __future__ import annotations

import socket
import struct

import pytest
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch
from tests.broker.conftest import WireClient, metadata_request, produce_request, req


def frame(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def assert_still_serving(port: int) -> None:
    client = WireClient(port)
    try:
        assert client.request(req(18, 3, client_software_name="x", client_software_version="1")).error_code == 0
    finally:
        client.close()


BAD_INPUT = {
    "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "absurd length": struct.pack(">i", 0x7FFFFFFF) + b"\x00" * 64,
    "negative length": struct.pack(">i", -5) + b"\x00" * 16,
    "zero length": struct.pack(">i", 0),
    "shorter than a header": frame(b"\x00\x03\x00"),
    "unknown api key": frame(struct.pack(">hhih", 9999, 0, 1, -1)),
    "api not implemented yet (JoinGroup)": frame(struct.pack(">hhih", 11, 5, 1, -1)),
    "unsupported Metadata version": frame(struct.pack(">hhih", 3, 13, 1, -1) + b"\x00" * 8),
    "unsupported Produce version": frame(struct.pack(">hhih", 0, 2, 1, -1) + b"\x00" * 8),
    "truncated Metadata body": frame(struct.pack(">hhih", 3, 1, 1, -1) + struct.pack(">i", 5)),
    "string length past the end": frame(struct.pack(">hhih", 3, 1, 1, 200) + b"abc"),
    # kio's native reader would try to allocate this whole array up front and abort the process.
    "huge compact array count (Produce v9)": frame(
        struct.pack(">hhih", 0, 9, 1, -1) + b"\x00" + b"\x01" + struct.pack(">hi", -1, 1000)
        + b"\xff\xff\xff\xff\x0f"),
    "huge legacy array count (Metadata v1)": frame(struct.pack(">hhih", 3, 1, 1, -1) + struct.pack(">i", 2**31 - 1)),
    # Null where the schema has no null: kio would decode None and the handler would trip.
    "null non-nullable array (ListOffsets v1)": frame(struct.pack(">hhih", 2, 1, 1, -1) + struct.pack(">ii", -1, -1)),
    "null non-nullable string (FindCoordinator v0)": frame(struct.pack(">hhih", 10, 0, 1, -1) + struct.pack(">h", -1)),
    "bad utf-8 in client id": frame(struct.pack(">hhih", 3, 1, 1, 2) + b"\xff\xfe" + struct.pack(">i", -1)),
}


@pytest.mark.parametrize("data", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_closes_the_connection(broker, wire, data):
    bystander = wire()
    bad = wire()
    bad.send_raw(data)
    assert bad.is_closed()
    assert_still_serving(broker.port)
    # A connection opened before the bad one is unaffected.
    assert bystander.request(metadata_request(12)).brokers[0].port == broker.port


def test_truncated_frame_then_eof(broker, wire):
    bad = wire()
    bad.send_raw(struct.pack(">i", 100) + b"\x00\x03\x00\x0c")
    bad.sock.shutdown(socket.SHUT_WR)
    assert bad.is_closed()
    assert_still_serving(broker.port)


def test_connection_dropped_mid_request(broker):
    for cut in (2, 4, 9, 30):
        s = socket.create_connection(("127.0.0.1", broker.port))
        payload = frame(struct.pack(">hhih", 3, 12, 1, 0) + b"\x00\x01\x00\x00\x00" * 5)
        s.sendall(payload[:cut])
        s.close()
    assert_still_serving(broker.port)


def test_request_size_limit_is_configurable(broker_factory, topic):
    b = broker_factory(max_request_bytes=64 * 1024)  # the smallest allowed
    client = WireClient(b.port)
    small = client.request(produce_request(topic, batch([b"x" * 100])))
    assert small.responses[0].partition_responses[0].error_code == ErrorCode.none
    client.send(produce_request(topic, batch([b"x" * 70_000])))
    assert client.is_closed()
    client.close()
    assert_still_serving(b.port)


def test_handler_exception_closes_only_that_connection(broker, wire, monkeypatch):
    from twophase.broker.apis import find_coordinator

    async def boom(broker, request):
        raise RuntimeError("handler bug")

    monkeypatch.setattr(find_coordinator, "handle", boom)
    bad = wire()
    bad.send(req(10, 3, key="g", key_type=0))
    assert bad.is_closed()
    assert_still_serving(broker.port)


def test_pipelined_requests_are_answered_in_order(wire, topic):
    client = wire()
    ids = [client.send(req(18, 0)), client.send(metadata_request(12, [topic])),
           client.send(produce_request(topic, batch([b"p"]))), client.send(req(18, 3, client_software_name="a",
                                                                              client_software_version="1"))]
    got = [struct.unpack_from(">i", client.recv_frame())[0] for _ in ids]
    assert got == ids
