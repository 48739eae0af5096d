"""Producer and consumer against the real broker, cross-checked with confluent-kafka: keys, headers,
every codec, murmur2 partitions, idempotent retries through a connection-dropping proxy, long polling."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import Producer as ConfluentProducer
from kio.schema.errors import ErrorCode

from tests.broker.batches import batch_offsets
from tests.broker.conftest import fetch_request
from tests.waiting import wait_for
from twophase.client import (Admin, Consumer, KafkaConnectionError, KafkaError, KafkaTimeout, Producer,
                             TransactionStateError)
from twophase.client.connection import Connection
from twophase.wire.api_keys import ApiKey

from .conftest import confluent_drain, drain, refuse_requests


def _all_partitions(consumer: Consumer, topic: str, n: int) -> Consumer:
    consumer.assign([(topic, p) for p in range(n)])
    return consumer


@pytest.mark.parametrize("compression", [None, "gzip", "snappy", "lz4", "zstd"])
def test_round_trip_keys_headers_and_values(broker, topic, compression):
    Admin(broker.bootstrap).create_topics({topic: 3})
    with Producer(broker.bootstrap, compression=compression, linger_ms=20) as p:
        for i in range(300):
            p.send(topic, value=b"v%d" % i, key=b"k%d" % (i % 13), headers=[("n", b"%d" % i), ("null", None)])
        p.send(topic, value=None, key=b"tombstone", partition=2, timestamp_ms=1234)
        p.flush()
    with _all_partitions(Consumer(broker.bootstrap), topic, 3) as c:
        got = drain(c, 301)
    assert len(got) == 301
    by_value = {m.value: m for m in got}
    assert by_value[b"v7"].key == b"k7" and by_value[b"v7"].headers == (("n", b"7"), ("null", None))
    tomb = by_value[None]
    assert (tomb.partition, tomb.timestamp_ms, tomb.key) == (2, 1234, b"tombstone")
    for p in range(3):  # per partition, offsets are dense and sends kept their order
        mine = [m for m in got if m.partition == p]
        assert [m.offset for m in mine] == list(range(len(mine)))
        values = [int(m.value[1:]) for m in mine if m.value]
        assert values == sorted(values)


def test_confluent_reads_ours_and_keys_land_on_the_same_partitions(broker, topic):
    Admin(broker.bootstrap).create_topics({topic: 5})
    keys = [b"user-%d" % i for i in range(50)]
    with Producer(broker.bootstrap, compression="gzip") as p:
        for k in keys:
            p.send(topic, value=b"ours:" + k, key=k, headers=[("src", b"twophase")])
    theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "partitioner": "murmur2_random",
                                "enable.idempotence": True})
    for k in keys:
        theirs.produce(topic, value=b"theirs:" + k, key=k)
    assert theirs.flush(10) == 0
    reader = ConfluentConsumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{topic}",
                                "auto.offset.reset": "earliest", "enable.auto.commit": False})
    reader.subscribe([topic])
    try:
        got = confluent_drain(reader, 100)
    finally:
        reader.close()
    partition_of = {}
    for _, partition, _, key, value, headers in got:
        origin = value.split(b":")[0]
        partition_of.setdefault(key, {})[origin] = partition
        if origin == b"ours":
            assert headers == [("src", b"twophase")]
    assert len(got) == 100
    assert all(p[b"ours"] == p[b"theirs"] for p in partition_of.values())
    assert len({p[b"ours"] for p in partition_of.values()}) == 5


def test_we_read_what_confluent_wrote(broker, topic):
    theirs = ConfluentProducer({"bootstrap.servers": broker.bootstrap, "compression.type": "gzip",
                                "linger.ms": 10})
    for i in range(200):
        theirs.produce(topic, value=b"%d" % i, key=b"k", headers=[("i", b"%d" % i)])
    assert theirs.flush(10) == 0
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        got = drain(c, 200)
    assert [m.value for m in got] == [b"%d" % i for i in range(200)]
    assert [m.headers for m in got[:2]] == [(("i", b"0"),), (("i", b"1"),)]


def test_seek_and_latest_reset(broker, topic):
    with Producer(broker.bootstrap) as p:
        for i in range(10):
            p.send(topic, value=b"%d" % i, partition=0)
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        c.seek(topic, 0, 7)
        assert [m.value for m in drain(c, 3)] == [b"7", b"8", b"9"]
        c.seek(topic, 0, -2)
        assert len(drain(c, 10)) == 10
    with Consumer(broker.bootstrap, auto_offset_reset="latest") as c:
        c.assign([(topic, 0)])
        assert c.poll(timeout_s=0.3) == []
        assert c.position(topic, 0) == 10
        with pytest.raises(KafkaError, match="not assigned"):
            c.seek(topic, 1, 0)


def test_long_poll_returns_as_soon_as_data_arrives(broker, topic):
    with Producer(broker.bootstrap, linger_ms=0) as p, Consumer(broker.bootstrap, max_wait_ms=60_000) as c:
        p.send(topic, value=b"first", partition=0)
        p.flush()
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1, settle_s=0)] == [b"first"]
        late = threading.Timer(0.5, lambda: (p.send(topic, value=b"late", partition=0), p.flush()))
        late.start()
        # One fetch, parked in the broker for the whole poll: the record arrives only if it wakes the fetch.
        got = c.poll(timeout_s=30)
        late.join()
    assert [m.value for m in got] == [b"late"]


def test_idempotent_retries_write_each_batch_once_and_in_order(broker, topic, monkeypatch):
    """The first Produce responses are lost after the broker wrote the batch (as when a connection
    drops): the producer resends the same batches, the broker deduplicates them."""
    original = Connection.request_many
    lost = {"left": 3, "seen": 0}

    def losing(self, requests, timeout_s=None, while_waiting=None):
        requests = list(requests)
        responses = original(self, requests, timeout_s, while_waiting)
        if requests[0].__api_key__ == ApiKey.PRODUCE:
            lost["seen"] += 1
            if lost["left"]:
                lost["left"] -= 1
                self.close()
                raise KafkaConnectionError("responses lost (test)")
        return responses

    monkeypatch.setattr(Connection, "request_many", losing)
    with Producer(broker.bootstrap, linger_ms=0, batch_size=200) as p:
        for i in range(40):
            p.send(topic, value=b"%03d" % i, partition=0)
        p.flush()
    monkeypatch.undo()
    assert lost == {"left": 0, "seen": lost["seen"]} and lost["seen"] > 3
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        got = drain(c, 40)
    assert [m.value for m in got] == [b"%03d" % i for i in range(40)]  # no duplicates, no reordering


def test_bad_input_gets_clear_errors(broker, topic):
    with pytest.raises(ValueError, match="acks"):
        Producer(broker.bootstrap, acks=1)
    with pytest.raises(ValueError, match="max_in_flight must be 1..5"):
        Producer(broker.bootstrap, max_in_flight=6)
    with pytest.raises(ValueError, match="HOST:PORT"):
        Producer("nohost")
    with Producer(broker.bootstrap) as p:
        p.send(topic, value=b"x")
        with pytest.raises(ValueError, match="partitions 0..0"):
            p.send(topic, value=b"x", partition=5)
    with pytest.raises(ValueError, match="isolation_level"):
        Consumer(broker.bootstrap, isolation_level="serializable")


def test_linger_sends_without_flush_and_batch_size_splits_batches(broker, topic):
    with Producer(broker.bootstrap, linger_ms=50, batch_size=1_000) as p, Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        for i in range(100):
            p.send(topic, value=b"%03d" % i + b"." * 40, partition=0)
        got = drain(c, 100, settle_s=0)  # no flush: the sender goes on its own after linger_ms
        assert [m.value[:3] for m in got] == [b"%03d" % i for i in range(100)]
    conn = Connection("127.0.0.1", broker.port)
    try:
        response = conn.request(fetch_request(topic, 0))
    finally:
        conn.close()
    batches = batch_offsets(response.responses[0].partitions[0].records)
    assert len(batches) > 5  # about 1 kB per batch, not one batch of everything


def test_a_send_that_keeps_failing_is_reported_by_flush(broker, topic, monkeypatch):
    with Producer(broker.bootstrap, retries=2) as p:
        p.send(topic, value=b"ok", partition=0)
        p.flush()
        refuse_requests(monkeypatch, ApiKey.PRODUCE, "network down (test)")
        p.send(topic, value=b"lost", partition=0)
        with pytest.raises(KafkaConnectionError, match="network down"):
            p.flush()
        monkeypatch.undo()
        p.send(topic, value=b"after", partition=0)  # a new producer id: sequences start over
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 2)] == [b"ok", b"after"]


def test_a_server_that_is_not_kafka_is_a_clear_connection_error():
    listener = socket.create_server(("127.0.0.1", 0))

    def http_server():
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=http_server, daemon=True).start()
    try:
        with pytest.raises(KafkaConnectionError, match="not plausible"):
            Connection("127.0.0.1", listener.getsockname()[1], timeout_s=5)
    finally:
        listener.close()


def test_a_negative_timestamp_is_refused_before_anything_is_queued(broker, topic):
    with Producer(broker.bootstrap) as p:
        with pytest.raises(ValueError, match="invalid timestamp -1"):
            p.send(topic, b"v", timestamp_ms=-1)
        with pytest.raises(ValueError, match="invalid timestamp -5"):
            p.send_many([(topic, None, None, b"v", None, -5)])
        with pytest.raises(ValueError, match="invalid timestamp -1"):
            p.send_many([(topic, None, None, b"v", None, None)], timestamp_ms=-1)
        p.flush()


RECORD = 24 + 100  # RECORD_OVERHEAD + a 100-byte value: what one record takes of buffer_memory


def hold_produce_requests(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(entered, gate): every Produce request waits for ``gate``; ``entered`` is set once one waits."""
    original = Connection.request_many
    entered, gate = threading.Event(), threading.Event()

    def held(self, requests, timeout_s=None, while_waiting=None):
        requests = list(requests)
        if requests[0].__api_key__ == ApiKey.PRODUCE:
            entered.set()
            assert gate.wait(30), "the test never opened the gate"
        return original(self, requests, timeout_s, while_waiting)

    monkeypatch.setattr(Connection, "request_many", held)
    return entered, gate


def await_waiting_for_room(p: Producer, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with p._cond:
            if p._room_waiters:
                return
        thread.join(0.01)
    raise AssertionError("no send waited for room")


def values_of(n: int) -> list[bytes]:
    return [b"%03d" % i + b"." * 97 for i in range(n)]


@pytest.mark.parametrize("transactional", [False, True])
def test_a_full_buffer_blocks_sends_until_acknowledgements_free_room(broker, topic, monkeypatch, transactional):
    """Kafka's back-pressure: with the broker's acknowledgements held back, a sender (send and send_many)
    queues what fits in buffer_memory and waits; once they come, it goes on, losing nothing."""
    entered, gate = hold_produce_requests(monkeypatch)
    values = values_of(40)
    sent: list[int] = []
    p = Producer(broker.bootstrap, linger_ms=0, batch_size=3 * RECORD, buffer_memory=10 * RECORD,
                 transactional_id=f"bp-{topic}" if transactional else None)
    try:
        if transactional:
            p.init_transactions()
            p.begin_transaction()

        def produce():
            for i in range(20):
                p.send(topic, value=values[i], partition=0)
                sent.append(i)
            p.send_many((topic, 0, None, values[i], None, None) for i in range(20, 40))
            sent.append(40)

        sending = threading.Thread(target=produce, daemon=True)
        sending.start()
        assert entered.wait(30)
        await_waiting_for_room(p, sending)
        assert sent == list(range(10))  # ten fit; the eleventh waits for room
        with p._cond:
            assert p._queued_bytes == 10 * RECORD
        gate.set()
        sending.join(30)
        assert not sending.is_alive() and sent[-1] == 40
        if transactional:
            p.commit_transaction()
        else:
            p.flush()
    finally:
        gate.set()
        p.close()
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 40)] == values  # each once, in order


def test_sends_waiting_for_room_get_it_in_the_order_they_came(broker, topic, monkeypatch):
    """A large record waiting for room is not overtaken by a small one that came after it, although the
    first acknowledgements free room for the small one only (Kafka's buffer pool: first come, first served)."""
    entered, gate = hold_produce_requests(monkeypatch)
    large, small = b"L" * (6 * RECORD - 24), b"s" * 100  # room once 6 of 10 queued are acknowledged / once 1 is
    with Producer(broker.bootstrap, linger_ms=0, batch_size=RECORD, buffer_memory=10 * RECORD) as p:
        for value in values_of(10):
            p.send(topic, value=value, partition=0)  # a full buffer, a batch per record

        def await_waiters(n: int) -> None:
            wait_for(lambda: len(p._room_waiters) == n, what=f"{n} sends waiting for room")

        large_send = threading.Thread(target=p.send, args=(topic, large, None, 0), daemon=True)
        large_send.start()
        await_waiters(1)
        small_send = threading.Thread(target=p.send, args=(topic, small, None, 0), daemon=True)
        small_send.start()
        await_waiters(2)
        assert entered.wait(30)  # the sender holds the first batches: nothing was acknowledged yet
        gate.set()
        large_send.join(30)
        small_send.join(30)
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 12)][10:] == [large, small]  # queued in the order they came


def test_a_send_waiting_for_room_sends_batches_that_still_linger(broker, topic):
    """A buffer full of open batches (batch_size above buffer_memory, a minute's linger): waiting sends
    them at once; nothing waits for the linger, and nothing times out."""
    values = values_of(30)
    with Producer(broker.bootstrap, linger_ms=60_000, batch_size=100 * RECORD, buffer_memory=10 * RECORD,
                  max_block_ms=20_000) as p:
        for value in values[:15]:
            p.send(topic, value=value, partition=0)
        p.send_many([(topic, 0, None, value, None, None) for value in values[15:]])
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 30)] == values


def test_a_send_that_finds_the_buffer_full_past_max_block_ms_raises_and_queues_nothing(broker, topic,
                                                                                       monkeypatch):
    entered, gate = hold_produce_requests(monkeypatch)
    values = values_of(12)
    with Producer(broker.bootstrap, linger_ms=0, buffer_memory=10 * RECORD, max_block_ms=100) as p:
        with pytest.raises(ValueError, match=r"larger than the producer's whole buffer, buffer_memory=1240"):
            p.send(topic, value=b"x" * (10 * RECORD), partition=0)
        for value in values[:10]:
            p.send(topic, value=value, partition=0)
        assert entered.wait(30)
        with pytest.raises(KafkaTimeout, match=r"buffer had no room for this send for max_block_ms \(100 ms\)"):
            p.send(topic, value=values[10], partition=0)
        with pytest.raises(KafkaTimeout, match="max_block_ms"):
            p.send_many([(topic, 0, None, values[11], None, None)])
        gate.set()
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 10)] == values[:10]


def test_a_record_larger_than_max_request_size_is_refused_and_the_others_go(broker, topic):
    """Kafka's max.request.size as it bounds one record (RecordTooLargeException in Java's client)."""
    with Producer(broker.bootstrap, max_request_size=2 * RECORD) as p:
        with pytest.raises(ValueError, match=r"larger than max_request_size=248"):
            p.send(topic, value=b"x" * (2 * RECORD), partition=0)
        with pytest.raises(ValueError, match=r"larger than max_request_size=248"):
            p.send_many([(topic, 0, None, b"x" * (2 * RECORD), None, None)])
        p.send(topic, value=b"fits", partition=0)
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1)] == [b"fits"]


def test_a_send_many_that_times_out_half_queued_leaves_a_transaction_only_to_abort(broker, topic, monkeypatch):
    entered, gate = hold_produce_requests(monkeypatch)
    values = values_of(12)
    with Producer(broker.bootstrap, linger_ms=0, buffer_memory=10 * RECORD, max_block_ms=100,
                  transactional_id=f"half-{topic}") as p:
        p.init_transactions()
        p.begin_transaction()
        for value in values[:8]:
            p.send(topic, value=value, partition=0)
        assert entered.wait(30)
        with pytest.raises(KafkaTimeout, match="max_block_ms"):
            p.send_many([(topic, 0, None, value, None, None) for value in values[8:]])  # two of four fit
        with pytest.raises(TransactionStateError, match="abortable_error"):
            p.commit_transaction()
        gate.set()
        p.abort_transaction()
        p.begin_transaction()
        p.send(topic, value=b"after", partition=0)
        p.commit_transaction()
    with Consumer(broker.bootstrap, isolation_level="read_committed") as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1)] == [b"after"]


def gate_first_produce(monkeypatch, then) -> threading.Event:
    """Patch Connection.request_many: the first Produce pipeline waits for the returned event (set it once
    every send returned, so that later pipelines find every batch full), then each call goes through
    ``then(original, conn, requests, timeout_s, while_waiting)``."""
    original = Connection.request_many
    gate = threading.Event()

    def gated(self, requests, timeout_s=None, while_waiting=None):
        requests = list(requests)
        if requests[0].__api_key__ == ApiKey.PRODUCE:
            assert gate.wait(30), "the test never opened the gate"
        return then(original, self, requests, timeout_s, while_waiting)

    monkeypatch.setattr(Connection, "request_many", gated)
    return gate


@pytest.mark.parametrize("max_in_flight", [1, 5])
def test_the_next_full_batches_are_encoded_during_a_produce_round_trip(broker, topic, monkeypatch, max_in_flight):
    """The sender's work for the next request overlaps the broker's for this one; sealed (producer id,
    epoch, sequence) when sent, every batch arrives once and in order, also when the producer id changes
    in between."""
    ahead: list[int] = []  # per Produce pipeline: how many batches were encoded ahead during it
    reset_with_batches_ahead = threading.Event()
    p = Producer(broker.bootstrap, linger_ms=10_000, batch_size=1_000, max_in_flight=max_in_flight)

    def spying(original, conn, requests, timeout_s, while_waiting):
        if while_waiting is None:
            return original(conn, requests, timeout_s, while_waiting)

        def spy():
            while_waiting()
            with p._cond:
                ahead.append(sum(b.unsealed is not None for queue in p._queues.values() for b in queue))
            if ahead[-1] and len(ahead) > 1 and not reset_with_batches_ahead.is_set():
                p._producer_id = -1  # as after a dropped batch: the next send takes a new id, sequences from 0
                reset_with_batches_ahead.set()
        return original(conn, requests, timeout_s, spy)

    gate = gate_first_produce(monkeypatch, spying)
    values = values_of(100)  # 13 batches of about 1,000 bytes
    with p:
        for value in values:
            p.send(topic, value=value, partition=0)
        gate.set()
        p.flush()
    assert reset_with_batches_ahead.is_set()
    assert len(ahead) >= 13 // max_in_flight and max(ahead) == max_in_flight  # what the next request(s) carry
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 100)] == values


def answered_with(response, code):
    """``response`` (a ProduceResponse) with every partition's error code set to ``code``."""
    return dataclasses.replace(response, responses=tuple(
        dataclasses.replace(t, partition_responses=tuple(
            dataclasses.replace(p, error_code=code) for p in t.partition_responses)) for t in response.responses))


def test_produce_requests_are_pipelined_and_batches_behind_a_failed_one_are_sent_again_after_it(
        broker, topic, monkeypatch):
    """Up to max_in_flight Produce requests go out before the first answer is read. The first request of
    one pipeline never reaches the broker, which answers the ones behind it OUT_OF_ORDER_SEQUENCE_NUMBER:
    the producer retries the first and then sends the others again, and every record lands once, in order."""
    pipelines: list[int] = []  # Produce requests per call
    dropped: list[int] = []  # the length of the pipeline whose first request was dropped

    def dropping_one(original, conn, requests, timeout_s, while_waiting):
        if requests[0].__api_key__ != ApiKey.PRODUCE:
            return original(conn, requests, timeout_s, while_waiting)
        pipelines.append(len(requests))
        if len(requests) < 3 or dropped:
            return original(conn, requests, timeout_s, while_waiting)
        dropped.append(len(requests))
        answered = original(conn, requests[1:], timeout_s, while_waiting)
        codes = {int(p.error_code) for r in answered for t in r.responses for p in t.partition_responses}
        assert codes == {ErrorCode.out_of_order_sequence_number}
        return [answered_with(answered[0], ErrorCode.request_timed_out), *answered]

    values = values_of(100)
    with Producer(broker.bootstrap, linger_ms=10_000, batch_size=1_000) as p:
        p.send(topic, value=b"first", partition=0)  # the broker knows the producer: a gap is out of order
        p.flush()
        gate = gate_first_produce(monkeypatch, dropping_one)
        for value in values:
            p.send(topic, value=value, partition=0)
        gate.set()
        p.flush()
    assert max(pipelines) == 5 and sum(pipelines) == 13 + dropped[0]  # pipelined; the dropped one's sent again
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 101)] == [b"first", *values]


def test_a_batch_dropped_for_good_takes_the_batches_sent_after_it_along_and_nothing_is_written_twice(
        broker, topic, monkeypatch):
    """The broker wrote a whole pipeline, but the first batch's answer is a non-retriable error: that batch
    and the ones sent after it are dropped and reported (the broker may hold them, so they are not sealed
    again under the producer's new id), the batches never sent go out under it, and no record is
    written twice."""
    refused = []

    def refusing_first(original, conn, requests, timeout_s, while_waiting):
        responses = original(conn, requests, timeout_s, while_waiting)
        if requests[0].__api_key__ == ApiKey.PRODUCE and len(requests) >= 3 and not refused:
            refused.append(len(requests))
            return [answered_with(responses[0], ErrorCode.invalid_timestamp), *responses[1:]]
        return responses

    values = values_of(100)
    with Producer(broker.bootstrap, linger_ms=10_000, batch_size=1_000) as p:
        gate = gate_first_produce(monkeypatch, refusing_first)
        for value in values:
            p.send(topic, value=value, partition=0)
        gate.set()
        with pytest.raises(KafkaError, match="INVALID_TIMESTAMP"):
            p.flush()
        p.send(topic, value=b"after", partition=0)
        p.flush()
    assert refused
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 101)] == [*values, b"after"]  # each once: none sealed again


def test_a_batch_that_cannot_be_encoded_ends_its_pipeline_and_fails_alone(broker, topic, monkeypatch):
    """Encoding fails for one batch in the middle of a pipeline: the requests before it are sent and
    settled, the batch is reported by flush, and every other record lands once, in order."""
    from twophase.client import producer as producer_module

    original_encode = producer_module.unsealed_batch
    poison = values_of(100)[50]

    def encode(records, compression):
        if any(value == poison for _, _, value, _ in records):
            raise MemoryError("cannot encode (test)")
        return original_encode(records, compression)

    monkeypatch.setattr(producer_module, "unsealed_batch", encode)
    values = values_of(100)
    gate = gate_first_produce(monkeypatch, lambda original, *call: original(*call))
    with Producer(broker.bootstrap, linger_ms=10_000, batch_size=1_000) as p:
        for value in values:
            p.send(topic, value=value, partition=0)
        gate.set()
        with pytest.raises(KafkaError, match="cannot encode a batch .* MemoryError: cannot encode"):
            p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        got = [m.value for m in drain(c, 92)]
    assert poison not in got and got == [v for v in values if v in got] and len(got) > 80  # once, in order


def test_records_the_sender_could_not_encode_are_refused_by_the_send(broker, topic):
    with Producer(broker.bootstrap) as p:
        with pytest.raises(TypeError, match="value must be bytes-like or None, not str"):
            p.send(topic, value="text")
        with pytest.raises(TypeError, match="key must be bytes-like or None, not int"):
            p.send_many([(topic, 0, 5, b"v", None, None)])
        with pytest.raises(TypeError, match="header's name must be a str, not bytes"):
            p.send_many([(topic, 0, None, b"v", [(b"h", b"x")], None)])
        with pytest.raises(TypeError, match="header 'h' must be bytes-like or None, not str"):
            p.send(topic, value=b"v", headers=[("h", "x")])
        p.send_many([(topic, 0, bytearray(b"k"), memoryview(b"v"), [("h", None)], None)])
        p.flush()
    with Consumer(broker.bootstrap) as c:
        c.assign([(topic, 0)])
        assert [(m.key, m.value) for m in drain(c, 1)] == [(b"k", b"v")]  # nothing of the refused ones


def test_work_during_a_round_trip_that_fails_closes_the_connection_and_raises(broker):
    conn = Connection("127.0.0.1", broker.port)

    def failing():
        raise OSError("no (test)")  # not taken for a lost connection: the hook's own error

    with pytest.raises(OSError, match="no"):
        conn.request(fetch_request("t", 0), while_waiting=failing)
    assert conn.closed  # its response is unread: no later request may read it as its own


def test_request_many_pipelines_in_order_and_closes_only_when_responses_are_left_unread(broker, topic):
    conn = Connection("127.0.0.1", broker.port)
    try:
        assert [int(r.responses[0].partitions[0].partition_index) for r in conn.request_many(
            fetch_request(topic, p) for p in (0, 0, 0))] == [0, 0, 0]

        def failing_at(n):
            for i in range(3):
                if i == n:
                    raise ValueError(f"cannot make request {i} (test)")
                yield fetch_request(topic, 0)

        with pytest.raises(ValueError, match="request 0"):
            conn.request_many(failing_at(0))
        assert not conn.closed  # nothing was sent: nothing is left unread
        assert conn.request(fetch_request(topic, 0)).responses[0].partitions[0].partition_index == 0  # usable
        with pytest.raises(ValueError, match="request 1"):
            conn.request_many(failing_at(1))
        assert conn.closed  # the first request's response is unread
    finally:
        conn.close()
