"""A load generator that costs almost no CPU: pre-encoded Kafka requests over a raw socket.

On a 2-core host a real client at 100 B records is the bottleneck, not the broker (see
bench/README.md: kcat used 4x the broker's CPU). To measure the broker, this replays the exact
RecordBatches a real client sent, read back from the broker's own log, as Produce requests
pipelined like that client's ``max.in.flight`` (5), and reads a partition back with Fetch requests
shaped like librdkafka's (one in flight, 1 MiB per partition, 50 MiB per fetch). Requests are
encoded before the clock starts; while it runs the client only sends, receives and checks error
codes, so the time measured is the broker's.

Example::

    batches = batches_of(data_dir, "recorded", warmup_batches=1)   # what the real client sent
    with WireLoad(broker.bootstrap) as load:
        seconds = load.produce("replayed", batches, repeat=20)     # every batch acknowledged
        seconds, records = load.fetch_all("replayed", end_offset)  # offsets 0 .. end_offset - 1
"""

from __future__ import annotations

import datetime
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence

from twophase.client.connection import decode_response, read_frame
from twophase.client.messages import message, part
from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import encode_request
from twophase.wire.records import HEADER_SIZE, parse_header, set_base_offset

PRODUCE_VERSION = 9  # librdkafka 2.x sends Produce v7-v9; the body of v3-v8 is the same
FETCH_VERSION = 11  # librdkafka 2.x's Fetch, the last version before flexible encoding
IN_FLIGHT = 5  # max.in.flight.requests.per.connection
PARTITION_MAX_BYTES = 1 << 20  # max.partition.fetch.bytes
FETCH_MAX_BYTES = 50 << 20  # fetch.max.bytes
_SIZE = struct.Struct(">i")
_CORRELATION_AT = 8  # in a frame: size (4), api key (2), api version (2), then the correlation id


class WireLoad:
    """One connection that replays Produce requests to one partition and reads it with Fetch requests."""

    def __init__(self, bootstrap: str, partition: int = 0) -> None:
        self.partition = partition
        host, port = bootstrap.rsplit(":", 1)
        self._sock = socket.create_connection((host, int(port)), timeout=60)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._correlation_id = 0

    def __enter__(self) -> WireLoad:
        return self

    def __exit__(self, *exc) -> None:
        self._sock.close()

    def _send(self, frame: bytes) -> int:
        """Send ``frame`` under a fresh correlation id (the frame itself is reused, never copied)."""
        self._correlation_id += 1
        head = frame[:_CORRELATION_AT] + _SIZE.pack(self._correlation_id)
        body = memoryview(frame)[_CORRELATION_AT + 4:]
        sent = self._sock.sendmsg([head, body])
        if sent < len(head):
            self._sock.sendall(head[sent:])
            sent = len(head)
        self._sock.sendall(body[sent - len(head):])
        return self._correlation_id

    def _receive(self, request, correlation_id: int):
        return decode_response(read_frame(self._sock), request, correlation_id)

    def produce(self, topic: str, batches: Sequence[bytes], repeat: int = 1, in_flight: int = IN_FLIGHT) -> float:
        """Seconds to produce ``batches``, ``repeat`` times over, to the partition of ``topic`` (acks=all).

        One batch per request, as a client with one partition sends them, at most ``in_flight`` unanswered;
        raises if any is refused.
        """
        requests = [_produce_request(topic, self.partition, batch) for batch in batches]
        frames = [encode_request(0, request, "wire-load") for request in requests]
        total = len(frames) * repeat
        pending: deque[tuple[object, int]] = deque()
        sent = 0
        t = time.perf_counter()
        for _ in range(total):
            while sent < total and len(pending) < in_flight:
                pending.append((requests[sent % len(frames)], self._send(frames[sent % len(frames)])))
                sent += 1
            _check_produced(self._receive(*pending.popleft()))
        return time.perf_counter() - t

    def fetch_all(self, topic: str, end_offset: int, isolation_level: int = 0) -> tuple[float, int]:
        """(seconds, records) to read the partition of ``topic`` from offset 0 up to ``end_offset``."""
        offset = records = 0
        t = time.perf_counter()
        while offset < end_offset:
            if time.perf_counter() - t > 300:
                raise RuntimeError(f"Fetch: offset {offset} of {end_offset} after 300 s")
            request = _fetch_request(topic, self.partition, offset, isolation_level)
            response = self._receive(request, self._send(encode_request(0, request, "wire-load")))
            partition = response.responses[0].partitions[0]
            if response.error_code or partition.error_code:
                raise RuntimeError(f"Fetch at offset {offset}: error {response.error_code or partition.error_code}")
            data = partition.records or b""
            pos = 0
            while len(data) - pos >= HEADER_SIZE:  # a fetch may end in part of a batch
                header = parse_header(data, pos)
                if pos + header.size > len(data):
                    break
                records += header.record_count
                offset = header.last_offset + 1
                pos += header.size
        return time.perf_counter() - t, records


def _produce_request(topic: str, partition: int, batch: bytes):
    wire = bytearray(batch)
    set_base_offset(wire, 0, 0, -1)  # as the client sent it: the broker assigns both
    data = part(ApiKey.PRODUCE, PRODUCE_VERSION, "PartitionProduceData", index=partition, records=bytes(wire))
    return message(ApiKey.PRODUCE, PRODUCE_VERSION, transactional_id=None, acks=-1,
                   timeout=datetime.timedelta(seconds=30),
                   topic_data=(part(ApiKey.PRODUCE, PRODUCE_VERSION, "TopicProduceData", name=topic,
                                    partition_data=(data,)),))


def _check_produced(response) -> None:
    for topic in response.responses:
        for partition in topic.partition_responses:
            if partition.error_code:
                raise RuntimeError(f"Produce to {topic.name}-{partition.index}: error {partition.error_code}")


def _fetch_request(topic: str, partition: int, offset: int, isolation_level: int):
    wanted = part(ApiKey.FETCH, FETCH_VERSION, "FetchPartition", partition=partition, current_leader_epoch=-1,
                     fetch_offset=offset, log_start_offset=-1, partition_max_bytes=PARTITION_MAX_BYTES)
    return message(ApiKey.FETCH, FETCH_VERSION, replica_id=-1, max_wait=datetime.timedelta(milliseconds=500),
                   min_bytes=1, max_bytes=FETCH_MAX_BYTES, isolation_level=isolation_level, session_id=0,
                   session_epoch=-1, rack_id="", forgotten_topics_data=(),
                   topics=(part(ApiKey.FETCH, FETCH_VERSION, "FetchTopic", topic=topic, partitions=(wanted,)),))
