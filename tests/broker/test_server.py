"""The protocol server over a raw socket: every supported API, version edge cases, long polls,
and the broker's lifecycle (restart, persisted state, data-directory lock)."""

from __future__ import annotations

import select
import struct
import time
import uuid

import pytest
from kio.index import load_request_schema
from kio.schema.api_versions.v0.response import ApiVersionsResponse as ApiVersionsResponseV0
from kio.schema.errors import ErrorCode
from kio.serial import entity_reader

from tests.broker.batches import batch, decode
from tests.broker.conftest import (
    MS,
    WireClient,
    create_topics_request,
    fetch_request,
    list_offsets_request,
    metadata_request,
    only_partition,
    produce_request,
    req,
    sub,
)
from tests.waiting import wait_until
from twophase.broker import APIS, Broker
from twophase.broker.storage import DataDirLockedError
from twophase.wire.codec import build, encode_request, nested

# -- ApiVersions --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_api_versions_lists_the_registry(wire, version):
    request = req(18, version, client_software_name="wire-test", client_software_version="1.0")
    response = wire().request(request)
    assert response.error_code == ErrorCode.none
    assert {(k.api_key, k.min_version, k.max_version) for k in response.api_keys} == \
        {(a.key, a.min_version, a.max_version) for a in APIS}


def test_api_versions_v3_response_header_has_no_tagged_fields(wire):
    client = wire()
    client.send(req(18, 3, client_software_name="x", client_software_version="1"))
    frame = client.recv_frame()
    # correlation id (4 bytes), then the body's error code directly: no header tag buffer.
    assert struct.unpack_from(">ih", frame, 0) == (1, 0)


@pytest.mark.parametrize("version", [4, 127])
def test_api_versions_unknown_version_gets_v0_body_with_unsupported_version(wire, version):
    client = wire()
    # What kafka-python 3 sends first: ApiVersions v4 (flexible header, v3-shaped body).
    frame = struct.pack(">hhih", 18, version, 99, 4) + b"test" + b"\x00" + b"\x03kp\x041.0\x00"
    client.send_raw(struct.pack(">i", len(frame)) + frame)
    response = client.recv_frame()
    assert struct.unpack_from(">i", response, 0) == (99,)
    body, used = entity_reader(ApiVersionsResponseV0)(response, 4)
    assert 4 + used == len(response)
    assert body.error_code == ErrorCode.unsupported_version
    assert (18, 0, 3) in {(k.api_key, k.min_version, k.max_version) for k in body.api_keys}
    # The connection stays usable: the client retries with v3.
    assert client.request(req(18, 3, client_software_name="kp", client_software_version="1")).error_code == 0


# -- Metadata -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1, 4, 9, 12])
def test_metadata_describes_the_single_broker(broker, wire, topic, version):
    response = wire().request(metadata_request(version, [topic]))
    [node] = response.brokers
    assert (node.node_id, node.host, node.port) == (0, "127.0.0.1", broker.port)
    if version >= 2:
        assert response.cluster_id == broker.cluster_id
    if version >= 1:
        assert response.controller_id == 0
    [t] = response.topics
    assert (t.error_code, t.name) == (ErrorCode.none, topic)  # auto-created
    [p] = t.partitions
    assert (p.partition_index, p.leader_id, p.replica_nodes, p.isr_nodes) == (0, 0, (0,), (0,))
    if version >= 7:
        assert p.leader_epoch == -1
    if version >= 10:
        assert t.topic_id == broker.call(broker.topics)[topic].topic_id


def test_metadata_auto_creation_respects_the_client_flag_and_names(wire, topic):
    client = wire()
    [t] = client.request(metadata_request(12, [topic], allow_auto=False)).topics
    assert t.error_code == ErrorCode.unknown_topic_or_partition
    [t] = client.request(metadata_request(12, ["bad/name"])).topics
    assert t.error_code == ErrorCode.invalid_topic_exception
    all_topics = client.request(metadata_request(12)).topics
    assert all_topics == ()


def test_metadata_without_broker_auto_creation(broker_factory, topic):
    b = broker_factory(auto_create_topics=False)
    client = WireClient(b.port)
    try:
        [t] = client.request(metadata_request(12, [topic])).topics
        assert t.error_code == ErrorCode.unknown_topic_or_partition
    finally:
        client.close()


def test_metadata_by_topic_id(broker, wire, topic):
    client = wire()
    client.request(metadata_request(12, [topic]))
    topic_id = broker.call(broker.topics)[topic].topic_id
    request = req(3, 12, topics=(sub(3, 12, "MetadataRequestTopic", name=None, topic_id=topic_id),
                                 sub(3, 12, "MetadataRequestTopic", name=None, topic_id=uuid.uuid4())),
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    found, missing = client.request(request).topics
    assert (found.name, found.error_code) == (topic, ErrorCode.none)
    assert (missing.name, missing.error_code) == (None, ErrorCode.unknown_topic_id)
    # Before v12 a response topic must have a name.
    request = req(3, 11, topics=(sub(3, 11, "MetadataRequestTopic", name=None, topic_id=uuid.uuid4()),),
                  allow_auto_topic_creation=False, include_topic_authorized_operations=False)
    [missing] = client.request(request).topics
    assert (missing.name, missing.error_code) == ("", ErrorCode.unknown_topic_id)


# -- FindCoordinator ------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "key_type"), [(0, 0), (1, 0), (1, 1), (2, 1), (3, 0), (3, 1)])
def test_find_coordinator_is_this_broker(broker, wire, version, key_type):
    response = wire().request(req(10, version, key="group-or-txn", key_type=key_type))
    assert (response.error_code, response.node_id, response.host, response.port) == \
        (ErrorCode.none, 0, "127.0.0.1", broker.port)


def test_find_coordinator_v4_batches_keys(broker, wire):
    response = wire().request(req(10, 4, key_type=0, coordinator_keys=("a", "b")))
    assert [(c.key, c.node_id, c.port, c.error_code) for c in response.coordinators] == \
        [("a", 0, broker.port, ErrorCode.none), ("b", 0, broker.port, ErrorCode.none)]
    response = wire().request(req(10, 4, key_type=7, coordinator_keys=("a",)))
    assert response.coordinators[0].error_code == ErrorCode.invalid_request


# -- CreateTopics / DeleteTopics ----------------------------------------------------------------


def test_create_topics_validation(broker, wire, topic):
    client = wire()
    response = client.request(create_topics_request(
        (topic, -1, -1, None), ("rf3", 1, 3, None), ("zero", 0, 1, None), ("bad name", 1, 1, None),
        ("badconf", 1, 1, {"cleanup.policy": "compact"}), ("good", 2, 1, {"retention.ms": "1000"})))
    results = {t.name: t for t in response.topics}
    assert results[topic].error_code == ErrorCode.none and results[topic].num_partitions == 1
    assert results[topic].topic_id == broker.call(broker.topics)[topic].topic_id
    assert results["rf3"].error_code == ErrorCode.invalid_replication_factor
    assert results["zero"].error_code == ErrorCode.invalid_partitions
    assert results["bad name"].error_code == ErrorCode.invalid_topic_exception
    assert results["badconf"].error_code == ErrorCode.invalid_config
    assert results["good"].error_code == ErrorCode.none and results["good"].num_partitions == 2
    again = client.request(create_topics_request((topic, 1, 1, None)))
    assert again.topics[0].error_code == ErrorCode.topic_already_exists
    twice = client.request(create_topics_request(("dup", 1, 1, None), ("dup", 1, 1, None)))
    assert [t.error_code for t in twice.topics] == [ErrorCode.invalid_request] * 2
    assert set(broker.call(broker.topics)) == {topic, "good"}


def test_create_topics_validate_only_creates_nothing(broker, wire, topic):
    response = wire().request(create_topics_request((topic, 3, 1, None), validate_only=True))
    assert response.topics[0].error_code == ErrorCode.none
    assert topic not in broker.call(broker.topics)


@pytest.mark.parametrize("version", [2, 5])
def test_create_topics_older_versions(broker, wire, topic, version):
    response = wire().request(create_topics_request((topic, 2, 1, None), version=version))
    assert response.topics[0].error_code == ErrorCode.none
    assert broker.call(broker.topics)[topic].partitions == 2


def test_delete_topics_by_name_and_id(broker, wire):
    client = wire()
    client.request(create_topics_request(("a", 1, 1, None), ("b", 1, 1, None)))
    response = client.request(req(20, 4, topic_names=("a", "nope"), timeout=10_000 * MS))
    assert [(r.name, r.error_code) for r in response.responses] == \
        [("a", ErrorCode.none), ("nope", ErrorCode.unknown_topic_or_partition)]
    b_id = broker.call(broker.topics)["b"].topic_id
    DeleteTopicState = nested(load_request_schema(20, 6), "DeleteTopicState")
    response = client.request(req(20, 6, timeout=10_000 * MS, topics=(
        build(DeleteTopicState, name=None, topic_id=b_id), build(DeleteTopicState, name=None, topic_id=uuid.uuid4()))))
    assert [(r.name, r.error_code) for r in response.responses] == \
        [("b", ErrorCode.none), (None, ErrorCode.unknown_topic_id)]
    assert broker.call(broker.topics) == {}


# -- InitProducerId -------------------------------------------------------------------------------


def test_init_producer_id_allocates_fresh_ids_across_restarts(broker_factory, tmp_path):
    data = tmp_path / "data"
    b = broker_factory(data_dir=data)
    client = WireClient(b.port)
    ids = [client.request(req(22, v, transactional_id=None, transaction_timeout=60_000 * MS,
                              producer_id=-1, producer_epoch=-1)) for v in range(5)]
    assert all(r.error_code == ErrorCode.none and r.producer_epoch == 0 for r in ids)
    assert [r.producer_id for r in ids] == list(range(ids[0].producer_id, ids[0].producer_id + 5))
    client.close()
    b.stop()
    b2 = broker_factory(data_dir=data)
    client = WireClient(b2.port)
    later = client.request(req(22, 4, transactional_id=None, transaction_timeout=60_000 * MS,
                               producer_id=-1, producer_epoch=-1))
    client.close()
    assert later.producer_id > ids[-1].producer_id
    assert b2.cluster_id == b.cluster_id


# -- Produce ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 5, 8, 9])
def test_produce_then_fetch(wire, topic, version):
    client = wire()
    first = only_partition(client.request(produce_request(topic, batch([b"a", b"b"]), version=version)))
    second = only_partition(client.request(produce_request(topic, batch([b"c"]), version=version)))
    assert (first.error_code, first.base_offset, second.base_offset) == (ErrorCode.none, 0, 2)
    fetched = only_partition(client.request(fetch_request(topic, 0)))
    assert fetched.high_watermark == 3
    assert [(o, v) for o, _, _, v in decode(fetched.records)] == [(0, b"a"), (1, b"b"), (2, b"c")]


def test_produce_acks_zero_sends_no_response(wire, topic):
    client = wire()
    client.send(produce_request(topic, batch([b"quiet"]), acks=0))
    # The next response on this connection answers the next request: nothing came for acks=0.
    response = client.request(list_offsets_request(topic, -1))
    assert response.topics[0].partitions[0].offset == 1


def test_produce_errors(wire, topic):
    client = wire()
    client.request(metadata_request(12, [topic]))
    assert only_partition(client.request(produce_request(topic, batch([b"x"]), acks=2))).error_code == \
        ErrorCode.invalid_required_acks
    corrupt = bytearray(batch([b"x"]))
    corrupt[-1] ^= 0xFF
    assert only_partition(client.request(produce_request(topic, bytes(corrupt)))).error_code == \
        ErrorCode.corrupt_message
    assert only_partition(client.request(produce_request(topic, batch([b"x"]), partition=5))).error_code == \
        ErrorCode.unknown_topic_or_partition
    assert only_partition(client.request(produce_request("bad/name", batch([b"x"])))).error_code == \
        ErrorCode.invalid_topic_exception


def test_idempotent_retry_is_acknowledged_with_original_offset(wire, topic):
    client = wire()
    pid = client.request(req(22, 4, transactional_id=None, transaction_timeout=60_000 * MS,
                             producer_id=-1, producer_epoch=-1)).producer_id
    data = batch([b"a", b"b"], producer_id=pid, producer_epoch=0, base_sequence=0)
    first = only_partition(client.request(produce_request(topic, data)))
    retry = only_partition(client.request(produce_request(topic, data)))
    assert (first.error_code, retry.error_code, first.base_offset, retry.base_offset) == (0, 0, 0, 0)
    gap = batch([b"c"], producer_id=pid, producer_epoch=0, base_sequence=5)
    assert only_partition(client.request(produce_request(topic, gap))).error_code == \
        ErrorCode.out_of_order_sequence_number
    assert client.request(list_offsets_request(topic, -1)).topics[0].partitions[0].offset == 2


# -- Fetch --------------------------------------------------------------------------------------------


def test_fetch_long_poll_is_woken_by_a_produce(wire, topic):
    fetcher, producer = wire(), wire()
    producer.request(metadata_request(12, [topic]))
    # A max wait far beyond the client's 10 s socket timeout: only the produce can answer it in time.
    fetcher.send(fetch_request(topic, 0, max_wait_ms=600_000))
    readable, _, _ = select.select([fetcher.sock], [], [], 0.3)
    assert not readable, "an empty fetch with min_bytes=1 must wait"
    producer.request(produce_request(topic, batch([b"wake"])))
    response = fetcher.recv(load_request_schema(1, 12), fetcher.correlation_id)
    assert [v for _, _, _, v in decode(only_partition(response).records)] == [b"wake"]


def test_fetch_waits_max_wait_when_min_bytes_is_not_reached(wire, topic):
    client = wire()
    client.request(produce_request(topic, batch([b"small"])))
    start = time.monotonic()  # before the broker's wait starts: a lower bound no load can break
    response = client.request(fetch_request(topic, 0, max_wait_ms=400, min_bytes=1 << 20))
    assert time.monotonic() - start >= 0.35
    assert [v for _, _, _, v in decode(only_partition(response).records)] == [b"small"]


def test_fetch_returns_at_once_when_data_is_there(wire, topic):
    client = wire()
    client.request(produce_request(topic, batch([b"here"])))
    # A max wait far beyond the client's 10 s socket timeout: answered at all means answered at once.
    response = only_partition(client.request(fetch_request(topic, 0, max_wait_ms=600_000)))
    assert [v for _, _, _, v in decode(response.records)] == [b"here"]


def test_fetch_size_limits_and_first_batch_rule(wire, topic):
    client = wire()
    for i in range(3):
        client.request(produce_request(topic, batch([bytes([i]) * 500])))
    # A first batch larger than every limit still comes back whole (KIP-74).
    one = only_partition(client.request(fetch_request(topic, 0, max_bytes=10, partition_max_bytes=10)))
    assert [o for o, _, _, _ in decode(one.records)] == [0]
    everything = only_partition(client.request(fetch_request(topic, 0)))
    assert [o for o, _, _, _ in decode(everything.records)] == [0, 1, 2]
    middle = only_partition(client.request(fetch_request(topic, 1, partition_max_bytes=800)))
    assert [o for o, _, _, _ in decode(middle.records)] == [1]


def test_fetch_errors(wire, topic):
    client = wire()
    client.request(produce_request(topic, batch([b"x"])))
    # Errors answer at once: with a max wait far beyond the client's 10 s socket timeout, a parked
    # request would fail the test with a timeout.
    out_of_range = only_partition(client.request(fetch_request(topic, 5, max_wait_ms=600_000)))
    assert out_of_range.error_code == ErrorCode.offset_out_of_range
    unknown = only_partition(client.request(fetch_request("no-such-topic", 0, max_wait_ms=600_000)))
    assert unknown.error_code == ErrorCode.unknown_topic_or_partition
    session = client.request(fetch_request(topic, 0, session_id=1234, session_epoch=3))
    assert session.error_code == ErrorCode.fetch_session_id_not_found


@pytest.mark.parametrize("version", [4, 7, 11])
def test_fetch_older_versions(wire, topic, version):
    client = wire()
    client.request(produce_request(topic, batch([b"v"])))
    response = client.request(fetch_request(topic, 0, version=version, session_epoch=0))
    part = only_partition(response)
    assert part.high_watermark == 1 and [v for _, _, _, v in decode(part.records)] == [b"v"]


# -- ListOffsets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 4, 6, 7])
def test_list_offsets(wire, topic, version):
    client = wire()
    client.request(produce_request(topic, batch([b"a", b"b", b"c"], timestamps=[100, 200, 300])))
    client.request(produce_request(topic, batch([b"d"], timestamps=[400])))

    def ask(ts):
        p = client.request(list_offsets_request(topic, ts, version=version)).topics[0].partitions[0]
        return p.error_code, p.offset, p.timestamp

    assert ask(-2)[:2] == (ErrorCode.none, 0)
    assert ask(-1)[:2] == (ErrorCode.none, 4)
    assert ask(150) == (ErrorCode.none, 1, 200)
    assert ask(400) == (ErrorCode.none, 3, 400)
    assert ask(401) == (ErrorCode.none, -1, -1)
    if version >= 7:
        assert ask(-3) == (ErrorCode.none, 3, 400)
    unknown = client.request(list_offsets_request(topic, -1, partition=9, version=version))
    assert unknown.topics[0].partitions[0].error_code == ErrorCode.unknown_topic_or_partition


# -- lifecycle --------------------------------------------------------------------------------------


def test_restart_keeps_topics_and_data(broker_factory, tmp_path, topic):
    data = tmp_path / "data"
    b = broker_factory(data_dir=data)
    client = WireClient(b.port)
    client.request(produce_request(topic, batch([b"durable"])))
    client.close()
    b.stop()
    b.stop()  # idempotent
    with Broker(str(data)) as again:
        client = WireClient(again.port)
        response = client.request(fetch_request(topic, 0))
        client.close()
        assert [v for _, _, _, v in decode(only_partition(response).records)] == [b"durable"]


def test_data_directory_is_locked(broker, tmp_path):
    with pytest.raises(DataDirLockedError):
        Broker(broker.data_dir).start()


def test_async_api(tmp_path, topic):
    import asyncio

    async def run():
        async with Broker(str(tmp_path / "d")) as b:
            reader, writer = await asyncio.open_connection("127.0.0.1", b.port)
            writer.write(encode_request(1, req(18, 0)))
            size = struct.unpack(">i", await reader.readexactly(4))[0]
            frame = await reader.readexactly(size)
            writer.close()
            return frame

    frame = asyncio.run(run())
    assert struct.unpack_from(">ih", frame) == (1, 0)


def test_parked_fetch_of_a_client_that_went_away_is_released(broker, wire, topic):
    client = wire()
    client.request(metadata_request(12, [topic]))
    client.send(fetch_request(topic, 0, max_wait_ms=600_000))
    wait_until(lambda: broker.call(lambda: bool(broker._waiters)), timeout=60, what="the fetch to park")
    client.close()
    # Released long before the 10 min max wait.
    wait_until(lambda: not broker.call(lambda: bool(broker._waiters)), timeout=60,
               what="the fetch of a client that left to be released")
