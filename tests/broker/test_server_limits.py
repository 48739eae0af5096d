"""Connection resource limits: the idle-connection timeout (connections.max.idle.ms) and the byte
budget for requests buffered across all connections (queued.max.request.bytes)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import struct
import time

import pytest
from confluent_kafka import Producer
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch, decode
from tests.broker.conftest import WireClient, fetch_request, only_partition, produce_request, req
from tests.waiting import wait_for
from twophase.broker.server import ByteBudget
from twophase.wire.codec import encode_request

API_VERSIONS = req(18, 3, client_software_name="limits-test", client_software_version="1")


def server(broker):
    return broker._server


# -- idle connections ---------------------------------------------------------------------------


def test_idle_connection_is_closed_after_the_timeout(broker_factory):
    broker = broker_factory(connections_max_idle_ms=1500)
    client = WireClient(broker.port, timeout=5)
    sent = time.monotonic()  # the broker's idle clock (loop.time(), the same monotonic clock) starts later
    assert client.request(API_VERSIONS).error_code == ErrorCode.none
    assert client.is_closed()
    assert time.monotonic() - sent >= 1.5  # not before the timeout: a lower bound no load can break
    wait_for(lambda: broker.call(lambda: server(broker).connection_count) == 0, what="connection forgotten")


def test_a_connection_that_keeps_sending_requests_stays_open(broker_factory):
    broker = broker_factory(connections_max_idle_ms=1000)
    client = WireClient(broker.port, timeout=5)
    # Each request follows the previous answer at once (no sleep that a loaded host could stretch
    # past the timeout), for well over the idle timeout in all.
    started = time.monotonic()
    while time.monotonic() - started < 2.5:
        assert client.request(API_VERSIONS).error_code == ErrorCode.none
    assert broker.call(lambda: server(broker).connection_count) == 1
    client.close()


def test_a_parked_fetch_is_busy_not_idle(broker_factory, topic):
    broker = broker_factory(connections_max_idle_ms=1500)
    client = WireClient(broker.port, timeout=10)
    assert only_partition(client.request(produce_request(topic, batch([b"a"])))).error_code == ErrorCode.none
    start = time.monotonic()
    parked = only_partition(client.request(fetch_request(topic, 1, max_wait_ms=1500)))
    assert time.monotonic() - start >= 1.4  # parked for 5 idle timeouts and still answered
    assert parked.error_code == ErrorCode.none and parked.records in (b"", None)
    assert client.request(API_VERSIONS).error_code == ErrorCode.none
    assert client.is_closed()  # idle again after the answer


def test_a_client_stalling_mid_request_is_closed(broker_factory):
    broker = broker_factory(connections_max_idle_ms=1500)
    client = WireClient(broker.port, timeout=5)
    client.send_raw(struct.pack(">i", 100) + b"\x00\x12")  # promises 100 bytes, sends 2
    assert client.is_closed()
    wait_for(lambda: broker.call(lambda: server(broker).budget.available) == server(broker).budget.capacity,
             what="the stalled request's bytes returned to the budget")


def test_confluent_producer_reconnects_after_an_idle_close(broker_factory, topic):
    # Long enough that a reconnect handshake on a loaded 2-core CI host is not itself cut off as idle.
    broker = broker_factory(connections_max_idle_ms=1500)
    # librdkafka reconnects to closed connections with a backoff growing up to 10 s; with a
    # short idle timeout that backoff, not the broker, would decide how long the test takes.
    producer = Producer({"bootstrap.servers": broker.bootstrap, "log_level": 0, "reconnect.backoff.max.ms": 200})
    delivered = []
    producer.produce(topic, b"before", on_delivery=lambda err, msg: delivered.append(err))
    assert producer.flush(10) == 0
    wait_for(lambda: broker.call(lambda: server(broker).connection_count) == 0, what="idle connections closed")
    producer.produce(topic, b"after", on_delivery=lambda err, msg: delivered.append(err))
    assert producer.flush(30) == 0
    assert delivered == [None, None]
    client = WireClient(broker.port)
    assert [v for _, _, _, v in decode(only_partition(client.request(fetch_request(topic, 0))).records)] == \
        [b"before", b"after"]
    client.close()


# -- the request byte budget --------------------------------------------------------------------


def test_byte_budget_grants_in_order_and_never_more_than_it_has():
    async def scenario():
        budget = ByteBudget(100)
        assert await budget.acquire(60) == 60
        big = asyncio.ensure_future(budget.acquire(500))  # larger than the pool: takes all of it
        small = asyncio.ensure_future(budget.acquire(10))  # fits, but waits its turn behind big
        await asyncio.sleep(0)
        assert budget.waiting == 2 and not big.done() and not small.done()
        budget.release(60)
        assert await big == 100 and budget.available == 0 and not small.done()
        budget.release(100)
        assert await small == 10 and budget.available == 90
        # A cancelled waiter does not block the ones behind it.
        held = await budget.acquire(90)
        stuck = asyncio.ensure_future(budget.acquire(100))
        behind = asyncio.ensure_future(budget.acquire(5))
        await asyncio.sleep(0)
        stuck.cancel()
        budget.release(held)
        assert await behind == 5 and budget.available == 85  # small still holds 10
        with pytest.raises(ValueError):
            ByteBudget(0)

    asyncio.run(scenario())


def budget_held_by_a_parked_fetch(broker_factory, topic):
    """(broker, a client that produced one record, the client whose parked Fetch holds most of the
    broker's 48 KiB request budget)."""
    broker = broker_factory(queued_max_request_bytes=48 * 1024, fsync=1000)
    budget = server(broker).budget
    client = WireClient(broker.port, timeout=30)
    assert only_partition(client.request(produce_request(topic, batch([b"first"])))).error_code == ErrorCode.none
    holder = WireClient(broker.port)
    holder.send(fetch_request(topic, 1, max_wait_ms=120_000), client_id="h" * 30_000)
    wait_for(lambda: broker.call(lambda: budget.available) < 48 * 1024 - 30_000, what="the parked fetch's bytes")
    return broker, client, holder


def test_a_full_budget_stops_reading_and_drops_nothing(broker_factory, topic):
    """A parked Fetch holds most of a 48 KiB budget; a client pipelining 20 KiB produce requests is
    not read any more (its socket fills up and blocks) until the Fetch's client goes away; then
    every request it sent is answered and stored."""
    broker, pipeline, holder = budget_held_by_a_parked_fetch(broker_factory, topic)
    budget = server(broker).budget

    frames = [encode_request(pipeline.correlation_id + 1 + i, produce_request(topic, batch([bytes([i % 256]) * 20_000])))
              for i in range(4000)]
    pipeline.sock.setblocking(False)
    sent = 0  # bytes of the concatenated frames accepted by the kernel
    stream = memoryview(b"".join(frames))
    while sent < len(stream):
        _, writable, _ = select.select([], [pipeline.sock], [], 0.2)
        # The socket is full: done once the broker is known to wait for the budget (not merely slow to read).
        if not writable and broker.call(lambda: budget.waiting) == 1:
            break
        with contextlib.suppress(BlockingIOError):
            sent += pipeline.sock.send(stream[sent:sent + 65536])
    assert sent < len(stream), "the broker kept reading while its request budget was exhausted"
    assert broker.call(lambda: budget.waiting) == 1
    assert broker.call(lambda: budget.available) < 20_000

    holder.close()  # the parked fetch ends at once and gives its bytes back
    pipeline.sock.setblocking(True)
    pipeline.sock.settimeout(60)
    complete = -(-sent // len(frames[0]))  # requests at least partly sent: finish the last one
    pipeline.sock.sendall(stream[sent:complete * len(frames[0])])
    offsets = []
    for i in range(complete):
        response = pipeline.recv(type(produce_request(topic, b"")), pipeline.correlation_id + 1 + i)
        part = only_partition(response)
        assert part.error_code == ErrorCode.none
        offsets.append(part.base_offset)
    assert offsets == list(range(1, complete + 1))
    pipeline.sock.setblocking(True)
    last = only_partition(pipeline.request(fetch_request(topic, complete, partition_max_bytes=1 << 16)))
    assert last.high_watermark == complete + 1
    assert [v for _, _, _, v in decode(last.records)][0] == bytes([(complete - 1) % 256]) * 20_000
    assert broker.call(lambda: budget.available) == budget.capacity
    pipeline.close()


# -- reading requests ---------------------------------------------------------------------------


def test_a_large_request_arriving_in_pieces_is_read_whole_and_what_follows_is_kept(broker_factory, topic):
    """A produce request larger than the read-ahead buffer goes straight into a buffer of its own;
    bytes after it in the same packet (the next request) must not be lost."""
    broker = broker_factory()
    client = WireClient(broker.port, timeout=30)
    value = bytes(range(256)) * 3500  # 896 KB: far above the read-ahead, below max_message_bytes
    big = encode_request(1, produce_request(topic, batch([value])))
    small = encode_request(2, API_VERSIONS)
    pieces = [big[i:i + 200_000] for i in range(0, len(big) - 1000, 200_000)]
    for piece in pieces:
        client.send_raw(piece)
        time.sleep(0.02)  # separate packets, so the frame is filled by several reads
    client.send_raw(big[sum(map(len, pieces)):] + small)  # the end of the big one and the next request
    produced = only_partition(client.recv(type(produce_request(topic, b"")), 1))
    assert produced.error_code == ErrorCode.none and produced.base_offset == 0
    assert client.recv(type(API_VERSIONS), 2).error_code == ErrorCode.none
    client.correlation_id = 2
    fetched = only_partition(client.request(fetch_request(topic, 0, partition_max_bytes=8 << 20, max_bytes=8 << 20)))
    assert [v for _, _, _, v in decode(fetched.records)] == [value]


def test_a_client_leaving_mid_way_through_a_large_request_returns_its_bytes(broker_factory, topic):
    broker = broker_factory()
    budget = server(broker).budget
    client = WireClient(broker.port)
    big = encode_request(1, produce_request(topic, batch([b"x" * (1 << 20)])))
    client.send_raw(big[:300_000])
    wait_for(lambda: broker.call(lambda: budget.available) < budget.capacity, what="the request's bytes taken")
    client.close()
    wait_for(lambda: broker.call(lambda: budget.available) == budget.capacity, what="the bytes returned")
    wait_for(lambda: broker.call(lambda: server(broker).connection_count) == 0, what="the connection closed")
    assert_serving = WireClient(broker.port)
    assert assert_serving.request(API_VERSIONS).error_code == ErrorCode.none
    assert_serving.close()


def test_a_request_waiting_for_the_budget_holds_no_buffer_of_its_own(broker_factory, topic):
    """A large request's buffer is made once its first step of bytes is reserved: connections waiting
    for the budget cost the broker their read-ahead only, and the request is answered once it gets it."""
    broker, waiting, holder = budget_held_by_a_parked_fetch(broker_factory, topic)
    budget = server(broker).budget
    big = encode_request(2, produce_request(topic, batch([b"x" * 100_000])))
    waiting.send_raw(big[:70_000])  # more than the 64 KiB read-ahead holds
    wait_for(lambda: broker.call(lambda: budget.waiting) == 1, what="the large request waiting for the budget")
    assert broker.call(lambda: [conn._frame for conn in server(broker)._connections]) == [None, None]
    holder.close()  # the parked fetch ends and gives its bytes back
    waiting.send_raw(big[70_000:])
    assert only_partition(waiting.recv(type(produce_request(topic, b"")), 2)).error_code == ErrorCode.none
    waiting.close()


def test_a_request_read_ahead_never_queues_for_the_budget_behind_its_own_connection(broker_factory, topic):
    # A parks a Fetch, then sends a Produce larger than the free budget. Queued for the budget, that
    # Produce would wait for A's own Fetch to end, and every other connection would wait behind it.
    broker = broker_factory(queued_max_request_bytes=64 * 1024)
    with WireClient(broker.port) as setup:
        assert only_partition(setup.request(produce_request(topic, batch([b"x"])))).error_code == 0
    a = WireClient(broker.port, timeout=90)
    a.send(fetch_request(topic, 1, max_wait_ms=60_000))  # parked for the whole test
    a.send(produce_request(topic, batch([b"y" * (80 * 1024)])))
    # Its size prefix was read: the rest waits, the read-ahead fills and reading pauses.
    wait_for(lambda: broker.call(lambda: any(c._reading_paused for c in server(broker)._connections)),
             what="A's Produce waiting for bytes")
    with WireClient(broker.port) as b:
        assert b.request(API_VERSIONS).error_code == ErrorCode.none
    # B was answered while A's Fetch is still parked: B did not wait for it.
    assert select.select([a.sock], [], [], 0)[0] == [], "A's Fetch was answered before B's request"
    assert broker.call(lambda: server(broker).budget.waiting) == 0
    a.close()
