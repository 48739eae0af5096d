"""Attack: Fetch requests asking for everything at once (issue 11, item 6).

Before the fix a Fetch with max_bytes 2^31-1 was answered with the whole partition: it cost about
2.5 times the response in broker memory, four in parallel took 2.5 GB and each blocked the event
loop for seconds. Now each response is capped by the broker's fetch_max_bytes (its first batch
still goes out whole), the record bytes of all responses being read or sent share a budget
(fetch_bytes_in_flight), and responses are read a step at a time between other requests.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from kio.schema.errors import ErrorCode

from tests.broker.batches import batch, batch_offsets
from tests.broker.conftest import (
    WireClient,
    fetch_request,
    metadata_request,
    only_partition,
    produce_request,
    req,
)
from tests.waiting import wait_until
from twophase.wire.codec import encode_request

MIB = 1024 * 1024
# --fetch-max-bytes: above what the kernel's socket buffers (4 MiB on Linux) take of an unread response.
CAP = 8 * MIB
IN_FLIGHT = 2 * CAP  # --fetch-bytes-in-flight
EVERYTHING = 2**31 - 1
API_VERSIONS = req(18, 3, client_software_name="fetch-cost-test", client_software_version="1")
BATCHES = 48  # of about 1 MB each: a partition six times the cap


def memory_kib(pid: int, field: str) -> int:
    """A memory figure of a process from /proc (VmRSS: resident now, VmHWM: the peak since a reset)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for process {pid}")


def big_fetch(topic: str):
    return fetch_request(topic, 0, max_bytes=EVERYTHING, partition_max_bytes=EVERYTHING)


def non_reader(port: int, topic: str) -> socket.socket:
    """A client that asks for everything and reads nothing, with a receive buffer so small that the
    answer cannot hide in the kernel's socket buffers: it stays with the broker."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    sock.sendall(encode_request(1, big_fetch(topic)))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end has closed the connection (what arrives before is discarded)."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


def test_fetches_of_everything_are_capped_and_cost_bounded_memory(broker_cli, topic):
    broker = broker_cli("--fetch-max-bytes", str(CAP), "--fetch-bytes-in-flight", str(IN_FLIGHT),
                        "--request-receive-timeout-ms", "3000", "--fsync", "1000")
    with WireClient(broker.port, timeout=60) as producer:
        for i in range(BATCHES):
            response = producer.request(produce_request(topic, batch([bytes([i]) * 1_000_000])))
            assert only_partition(response).error_code == ErrorCode.none

    # From here on, the broker's peak resident memory counts from what it holds now.
    with open(f"/proc/{broker.proc.pid}/clear_refs", "w") as f:
        f.write("5")
    baseline = memory_kib(broker.proc.pid, "VmRSS")

    with contextlib.ExitStack() as stack:
        # Four clients that ask for everything and read nothing of the answer: without a budget their
        # responses would all sit in the broker; with it they hold at most the budget.
        for _ in range(4):
            stack.enter_context(non_reader(broker.port, topic))
        # Four that ask for everything and read it: capped, and cut short where the budget is.
        answers: list = []
        failures: list[BaseException] = []

        def fetch_everything() -> None:
            try:
                with WireClient(broker.port, timeout=120) as client:
                    answers.append(only_partition(client.request(big_fetch(topic))))
            except BaseException as exc:  # reported by the assertion below
                failures.append(exc)

        readers = [threading.Thread(target=fetch_everything) for _ in range(4)]
        for thread in readers:
            thread.start()

        # Meanwhile a new client's small requests are answered.
        with WireClient(broker.port, timeout=60) as client:
            assert client.request(API_VERSIONS).error_code == ErrorCode.none
            [described] = client.request(metadata_request(12, [topic])).topics
            assert described.error_code == ErrorCode.none

        for thread in readers:
            thread.join(timeout=180)
        assert not failures and len(answers) == 4
        for answer in answers:
            assert answer.error_code == ErrorCode.none and answer.high_watermark == BATCHES
            assert 0 < len(answer.records) <= CAP
            offsets = batch_offsets(answer.records)
            assert [base for base, _ in offsets] == list(range(len(offsets)))  # whole batches from offset 0

    # Records in flight never exceeded the budget: the peak stays within a few caps (the responses
    # held, plus the one being encoded), far below the 8 x 48 MB the requests asked for.
    growth = (memory_kib(broker.proc.pid, "VmHWM") - baseline) * 1024
    assert growth < 6 * CAP, f"broker memory grew by {growth / MIB:.1f} MiB"


def test_a_client_reading_nothing_of_its_response_is_closed_and_gives_its_budget_back(broker_factory, topic):
    broker = broker_factory(fetch_max_bytes=CAP, request_receive_timeout_ms=1000, fsync=1000)
    with WireClient(broker.port, timeout=60) as producer:
        for i in range(12):
            response = producer.request(produce_request(topic, batch([bytes([i]) * 1_000_000])))
            assert only_partition(response).error_code == ErrorCode.none
    budget = broker.fetch_budget
    with non_reader(broker.port, topic) as sock:
        wait_until(lambda: broker.call(lambda: budget.available) < budget.capacity, what="the response held")
        # The response does not fit in the socket buffers, so the broker waits for the client to read.
        wait_until(lambda: broker.call(lambda: budget.available) == budget.capacity, timeout=60,
                   what="the connection closed and the budget given back")
        assert closed_by_peer(sock)


def test_a_first_batch_larger_than_the_cap_is_returned_whole(broker_factory, topic):
    broker = broker_factory(fetch_max_bytes=64 * 1024)
    with WireClient(broker.port, timeout=60) as client:
        for value in (b"a" * 200_000, b"b" * 10):
            assert only_partition(client.request(produce_request(topic, batch([value])))).error_code == 0
        first = only_partition(client.request(big_fetch(topic)))
        assert [base for base, _ in batch_offsets(first.records)] == [0]  # the large batch, alone
        second = only_partition(client.request(fetch_request(topic, 1, max_bytes=EVERYTHING,
                                                              partition_max_bytes=EVERYTHING)))
        assert [base for base, _ in batch_offsets(second.records)] == [1]
    wait_until(lambda: broker.call(lambda: broker.fetch_budget.available) == broker.fetch_budget.capacity,
               what="the responses' bytes given back to the fetch budget")


def test_a_fetch_waits_for_the_budget_no_longer_than_its_max_wait_or_its_client(broker_factory, topic):
    broker = broker_factory()
    budget = broker.fetch_budget
    with WireClient(broker.port, timeout=30) as client:
        assert only_partition(client.request(produce_request(topic, batch([b"x"])))).error_code == ErrorCode.none
        broker.call(lambda: budget.take(budget.capacity))  # held, as by slow readers' unread responses
        try:
            # Answered at its max_wait with nothing (the client asks again), not when the budget frees.
            starved = only_partition(client.request(fetch_request(topic, 0, max_wait_ms=200)))
            assert starved.error_code == ErrorCode.none and not starved.records
            # A client that leaves while its Fetch waits for the budget gives up its place.
            with WireClient(broker.port, timeout=30) as leaving:
                leaving.send(fetch_request(topic, 0, max_wait_ms=600_000))
                wait_until(lambda: broker.call(lambda: budget.waiting) == 1, what="its fetch waiting")
            wait_until(lambda: broker.call(lambda: budget.waiting) == 0, what="its place given up")
        finally:
            broker.call(lambda: budget.release(budget.capacity))
        fetched = only_partition(client.request(fetch_request(topic, 0, max_wait_ms=200)))
        assert [base for base, _ in batch_offsets(fetched.records)] == [0]
    wait_until(lambda: broker.call(lambda: budget.available) == budget.capacity, what="the budget given back")


def test_one_response_takes_at_most_its_share_of_the_budget(broker_factory, topic):
    in_flight = 8 * MIB  # one response's share: an eighth, 1 MiB
    broker = broker_factory(fetch_bytes_in_flight=in_flight)
    with WireClient(broker.port, timeout=60) as client:
        for i in range(8):
            response = client.request(produce_request(topic, batch([bytes([i]) * 400_000])))
            assert only_partition(response).error_code == ErrorCode.none
        fetched = only_partition(client.request(big_fetch(topic)))
        assert [base for base, _ in batch_offsets(fetched.records)] == [0, 1]  # not all 8 (3.2 MB)
        assert len(fetched.records) <= in_flight // 8
