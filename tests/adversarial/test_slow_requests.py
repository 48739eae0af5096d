"""Attack: connections that announce huge requests and send nothing more (issue 11, item 5).

Before the fix the broker reserved a request's whole announced size from the shared request-byte
budget before reading it, so two connections announcing 100 MiB each took the whole 200 MiB
budget and every other request, even a client's first ApiVersions, waited for the 10-minute idle
timeout. Now bytes are reserved step by step as they arrive, and a request whose bytes do not all
arrive in time closes its connection: the receive timeout is a progress timeout, each step of up to
1 MiB has to arrive within it.
"""

from __future__ import annotations

import asyncio
import struct
import threading

from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import Producer as ConfluentProducer
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch
from tests.broker.conftest import (
    WireClient,
    metadata_request,
    only_partition,
    produce_request,
    req,
)
from tests.waiting import wait_for, wait_until
from twophase.broker.server import MIB, ByteBudget
from twophase.client import Consumer, Producer
from twophase.wire.codec import encode_request

API_VERSIONS = req(18, 3, client_software_name="slow-test", client_software_version="1")
ANNOUNCED = 100 * MIB  # the broker's default max_request_bytes: the largest request it accepts


def stall(broker, announced: int = ANNOUNCED) -> WireClient:
    """A connection that announces a request of ``announced`` bytes, sends its first bytes and stops."""
    attacker = WireClient(broker.port, timeout=60)
    attacker.send_raw(struct.pack(">i", announced) + b"\x00\x00\x00\x09")  # a Produce v9 header start
    return attacker


def receiving(broker) -> int:
    """How many connections wait for the rest of a request from their client."""
    return broker.call(lambda: sum(c.receive_deadline is not None for c in broker._server._connections))


def test_two_stalled_100_mib_requests_lock_out_no_client(broker_factory, topic):
    # A receive timeout as long as the idle timeout: the clients below are served because nothing
    # is reserved up front, not because the stalled connections were closed.
    broker = broker_factory(request_receive_timeout_ms=600_000)
    with stall(broker), stall(broker):
        clients_are_served(broker, topic)


def clients_are_served(broker, topic: str) -> None:
    """While two connections stall: raw, twophase.client and confluent_kafka clients produce and consume."""
    wait_until(lambda: receiving(broker) == 2, what="both announced requests being received")
    budget = broker._server.budget
    assert broker.call(lambda: budget.capacity - budget.available) <= 2 * MIB  # a step each at most

    # A raw client's first request.
    with WireClient(broker.port, timeout=60) as client:
        assert client.request(API_VERSIONS).error_code == ErrorCode.none

    # twophase.client produces and consumes.
    producer = Producer(broker.bootstrap)
    try:
        producer.send(topic, b"from twophase.client", partition=0)
        producer.flush(60)
    finally:
        producer.close()
    consumer = Consumer(broker.bootstrap)
    try:
        consumer.assign([(topic, 0)])
        [message] = wait_for(lambda: consumer.poll(timeout_s=0.5), timeout=60, what="the record consumed")
        assert message.value == b"from twophase.client"
    finally:
        consumer.close()

    # confluent_kafka produces and consumes.
    delivered = []
    confluent = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "log_level": 0})
    confluent.produce(topic, b"from confluent", partition=0, on_delivery=lambda err, msg: delivered.append(err))
    assert confluent.flush(60) == 0 and delivered == [None]
    reader = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{topic}",
                                "auto.offset.reset": "earliest", "log_level": 0})
    try:
        reader.subscribe([topic])
        values = []

        def read_both() -> bool:
            msg = reader.poll(0.5)
            if msg is not None and msg.error() is None:
                values.append(msg.value())
            return len(values) == 2

        wait_until(read_both, timeout=60, what="confluent consuming both records")
        assert values == [b"from twophase.client", b"from confluent"]
    finally:
        reader.close()

    # The attackers are still connected, still holding no more than a step each.
    assert receiving(broker) == 2


def test_stalled_and_trickling_requests_are_closed_after_the_receive_timeout(broker_factory):
    broker = broker_factory(request_receive_timeout_ms=1000)
    budget = broker._server.budget
    stalled = [stall(broker), stall(broker, announced=1000)]  # a large and a small request
    # One byte at a time, each well within the timeout: a whole step (1 MiB) still has to arrive in time.
    trickler = stall(broker)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            try:
                trickler.send_raw(b"\x00")
            except OSError:
                return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        for attacker in [*stalled, trickler]:
            attacker.sock.settimeout(60)
            assert attacker.is_closed()  # EOF from the broker
    finally:
        stop.set()
        thread.join()
        for attacker in [*stalled, trickler]:
            attacker.close()
    wait_until(lambda: broker.call(lambda: budget.available) == budget.capacity,
               what="the stalled requests' bytes returned to the budget")
    with WireClient(broker.port) as client:
        assert client.request(API_VERSIONS).error_code == ErrorCode.none


def test_large_requests_that_together_exceed_the_budget_all_complete(broker_factory, topic):
    """Two 2.4 MiB produce requests against a 3 MiB budget, both half sent before either ends: each
    holds part of the budget and waits for more, and the oldest must be let through."""
    broker = broker_factory(queued_max_request_bytes=3 * MIB, fsync=1000)
    records = b"".join(batch([bytes([i]) * (800 * 1024)]) for i in range(3))
    frame = encode_request(1, produce_request(topic, records))
    clients = [WireClient(broker.port, timeout=60) for _ in range(2)]
    half = len(frame) // 2 + 300 * 1024
    for client in clients:
        client.send_raw(frame[:half])
    for client in clients:
        client.send_raw(frame[half:])
    for client in clients:
        response = client.recv(type(produce_request(topic, b"")), 1)
        assert only_partition(response).error_code == ErrorCode.none
        client.close()
    budget = broker._server.budget
    wait_until(lambda: broker.call(lambda: budget.available) == budget.capacity, what="the budget refilled")


def test_byte_budget_lets_the_oldest_of_stuck_step_takers_go_on():
    async def scenario():
        budget = ByteBudget(100)
        a = await budget.acquire(40, order=1)
        b = await budget.acquire(60, order=2)
        # b waits for more while holding 60 and a holds 40 without waiting: a may still give back.
        b_more = asyncio.ensure_future(budget.acquire(30, holding=b, order=2))
        await asyncio.sleep(0)
        assert not b_more.done()
        # Now a waits too: every byte is held by a waiter, and a is the older one.
        a_more = asyncio.ensure_future(budget.acquire(30, holding=a, order=1))
        await asyncio.sleep(0)
        assert a_more.done() and not b_more.done()
        assert budget.available == -30  # over by one step of one request
        budget.release(a + await a_more)
        assert await b_more == 30 and budget.available == 10

    asyncio.run(scenario())


def test_a_new_client_is_started_even_when_stalled_requests_hold_the_whole_budget(broker_factory, topic):
    # Two stalled connections hold a step each, which is all of a 2 MiB budget.
    broker = broker_factory(queued_max_request_bytes=2 * MIB, request_receive_timeout_ms=600_000)
    with stall(broker) as first, stall(broker) as second:
        for attacker in (first, second):
            attacker.send_raw(b"\x00" * (MIB + 1000))  # into its second step, then nothing more
        budget = broker._server.budget
        wait_until(lambda: broker.call(lambda: budget.available) <= 0,
                   what="the stalled requests holding the budget")
        with WireClient(broker.port, timeout=60) as client:
            assert client.request(API_VERSIONS).error_code == ErrorCode.none
            [described] = client.request(metadata_request(12, [topic])).topics
            assert described.error_code == ErrorCode.none


def test_a_large_request_on_a_slow_link_arrives_as_long_as_each_step_is_in_time(broker_factory, topic):
    """The receive timeout is a progress timeout: a 4 MB request sent a MiB every 1.2 s takes longer
    than the 2 s timeout in all, but each step of it arrives within it."""
    broker = broker_factory(request_receive_timeout_ms=2000, fsync=1000)
    request = produce_request(topic, b"".join(batch([bytes([i]) * 1_000_000]) for i in range(4)))
    frame = encode_request(1, request)
    step = 4 + MIB  # the size prefix and the first MiB, then a MiB at a time: one receive step each
    chunks = [frame[:step]] + [frame[at:at + MIB] for at in range(step, len(frame), MIB)]
    assert len(chunks) == 4
    link = threading.Event()  # never set: paces the sender like a slow link
    with WireClient(broker.port, timeout=60) as client:
        for i, chunk in enumerate(chunks):
            if i:
                link.wait(1.2)
            client.send_raw(chunk)
        assert only_partition(client.recv(type(request), 1)).error_code == ErrorCode.none
