"""Issue 11 item 3: hanging transactions, which no coordinator will end, and the tools to end them.

Two damages, each played on a real broker's data directory (stop, damage the files, start again):
the transaction log is lost while a prepared (2PC) transaction is open, and a COMMIT marker at a
partition's tail is torn. Before, the partition's last stable offset stayed where the transaction
began, for good, and ``twophase txns abort ID`` could not help (TRANSACTIONAL_ID_NOT_FOUND, or
success that changed nothing). Now the broker ends them at start (the missing COMMIT marker is
written again: committed data stays committed; a transaction of unknown outcome is aborted once
the longest transaction timeout has passed), and ``twophase txns find-hanging`` / ``abort
--topic ...`` (KIP-664: DescribeProducers and WriteTxnMarkers) let an operator end one sooner.
A real read_committed consumer checks each outcome.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct

import pytest

from tests.adversarial.reading import read_committed
from tests.waiting import wait_until
from twophase.broker.txn import TXN_DIR
from twophase.client import Admin, Producer
from twophase.client.cli import main as txns
from twophase.client.connection import Connection

LONG_TIMEOUT_MS = 3_600_000  # the broker would not abort a hanging transaction during the test by itself


def commit(bootstrap: str, transactional_id: str, topic: str, values: dict[int, bytes]) -> None:
    """One committed transaction writing ``values`` ({partition: value})."""
    with Producer(bootstrap, transactional_id=transactional_id) as p:
        p.init_transactions()
        p.begin_transaction()
        for partition, value in values.items():
            p.send(topic, value, partition=partition)
        p.commit_transaction()


def leave_prepared(bootstrap: str, topic: str, values: dict[int, bytes]) -> tuple[int, int]:
    """A 2PC transaction writing ``values``, prepared and left open (its producer is gone); its producer id
    and epoch."""
    p = Producer(bootstrap, transactional_id="prepared", enable_2pc=True)
    try:
        p.init_transactions()
        p.begin_transaction()
        for partition, value in values.items():
            p.send(topic, value, partition=partition)
        handle = p.prepare_transaction()
    finally:
        p.close()
    return handle.producer_id, handle.producer_epoch


def lose_transaction_log(broker_factory, data, topic: str, **options):
    """A broker on ``data`` with "before" committed and a prepared transaction open on both partitions of
    ``topic``, stopped; its transaction log deleted; started again with ``options``. The new broker and
    the prepared transaction's producer id and epoch."""
    broker = broker_factory(data_dir=data)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 2})
    commit(broker.bootstrap, "before", topic, {0: b"before-0", 1: b"before-1"})
    producer = leave_prepared(broker.bootstrap, topic, {0: b"prepared-0", 1: b"prepared-1"})
    broker.stop()
    shutil.rmtree(data / TXN_DIR)
    return broker_factory(data_dir=data, **options), producer


def open_transactions(bootstrap: str, topic: str) -> dict[tuple[str, int], list[int]]:
    """The producers with a transaction open on each partition of ``topic``, as DescribeProducers shows them."""
    with Admin(bootstrap) as admin:
        described = admin.describe_producers(admin.partitions_of(topic))
    return {tp: [s.producer_id for s in states if s.txn_start_offset is not None] for tp, states in described.items()}


def test_a_lost_transaction_log_leaves_no_partition_stuck(broker_factory, tmp_path, topic, caplog):
    data = tmp_path / "data"
    with caplog.at_level(logging.WARNING, "twophase.broker.txn"):
        # Clients' own transactions cannot outlast a 1 s maximum here: END records are written after a restart.
        broker, (producer_id, epoch) = lose_transaction_log(
            broker_factory, data, topic, transaction_max_timeout_ms=1000, transaction_check_interval_ms=50)
        assert open_transactions(broker.bootstrap, topic) == {(topic, 0): [producer_id], (topic, 1): [producer_id]}
        wait_until(lambda: open_transactions(broker.bootstrap, topic) == {(topic, 0): [], (topic, 1): []},
                   what="the broker aborting the transaction nobody knows any more")
    found = [r.getMessage() for r in caplog.records if "unknown to the transaction coordinator" in r.getMessage()]
    assert len(found) == 2, found  # one per partition, naming it, the producer and the start offset
    assert f"{topic}-0: open transaction of producer {producer_id} epoch {epoch} from offset 2" in found[0]
    assert any(f"aborting the hanging transaction of producer {producer_id}" in r.getMessage()
               for r in caplog.records)
    broker.stop()
    again = broker_factory(data_dir=data)  # aborted for good: nothing left to find after a restart
    with Admin(again.bootstrap) as admin:
        assert admin.find_hanging(topic=topic, max_transaction_timeout_ms=0) == []
    assert read_committed(again.bootstrap, topic, 2) == {0: [b"before-0"], 1: [b"before-1"]}


def tear_last_batch(partition_dir) -> None:
    """Cut the last batch of the partition's newest segment in half, as a crash mid-write would."""
    [name] = sorted(n for n in os.listdir(partition_dir) if n.endswith(".log"))[-1:]
    path = os.path.join(partition_dir, name)
    with open(path, "rb") as f:
        data = f.read()
    position = last = 0
    while position < len(data):
        last = position
        (length,) = struct.unpack_from(">i", data, position + 8)
        position += 12 + length
    assert position == len(data)
    with open(path, "r+b") as f:
        f.truncate(last + (len(data) - last) // 2)


def test_a_torn_commit_marker_is_written_again_and_the_commit_stays_visible(broker_factory, tmp_path, topic,
                                                                          caplog):
    data = tmp_path / "data"
    broker = broker_factory(data_dir=data)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 2})
    commit(broker.bootstrap, "before", topic, {0: b"before-0", 1: b"before-1"})
    commit(broker.bootstrap, "torn", topic, {0: b"committed-0", 1: b"committed-1"})
    broker.stop()
    tear_last_batch(data / f"{topic}-0")  # the COMMIT marker of "torn"
    with caplog.at_level(logging.WARNING, "twophase.broker.txn"):
        again = broker_factory(data_dir=data)
    assert any("is CompleteCommit in the transaction log but its marker is missing: writing the COMMIT marker"
               in r.getMessage() for r in caplog.records)
    expected = {0: [b"before-0", b"committed-0"], 1: [b"before-1", b"committed-1"]}
    assert read_committed(again.bootstrap, topic, 2) == expected
    again.stop()
    assert read_committed(broker_factory(data_dir=data).bootstrap, topic, 2) == expected


def test_an_operator_finds_and_aborts_a_hanging_transaction(broker_factory, tmp_path, topic, capsys):
    data = tmp_path / "data"
    broker, (producer_id, epoch) = lose_transaction_log(broker_factory, data, topic,
                                                        transaction_max_timeout_ms=LONG_TIMEOUT_MS)
    bootstrap = ["--bootstrap-server", broker.bootstrap, "--timeout", "10"]
    # A live transaction the coordinator holds open is not hanging, and cannot be aborted behind its back.
    live = Producer(broker.bootstrap, transactional_id="live")
    try:
        live.init_transactions()
        live.begin_transaction()
        live.send(topic, b"live-1", partition=1)
        live.flush()
        capsys.readouterr()
        assert txns([*bootstrap, "find-hanging", "--topic", topic, "--max-transaction-timeout", "0"]) == 0
        rows = capsys.readouterr().out.splitlines()[1:]
        assert [row.split()[:6] for row in rows] == [
            [topic, "0", str(producer_id), str(epoch), "-1", "2"], [topic, "1", str(producer_id), str(epoch), "-1", "2"]]
        assert txns([*bootstrap, "find-hanging", "--topic", topic]) == 0  # none open 15 minutes yet
        assert capsys.readouterr().out.splitlines()[1:] == []
        with Admin(broker.bootstrap) as admin:
            [live_state] = [s for s in admin.describe_producers([(topic, 1)])[(topic, 1)] if s.txn_start_offset == 3]
        assert txns([*bootstrap, "abort", "--topic", topic, "--partition", "1", "--producer-id",
                     str(live_state.producer_id), "--producer-epoch", str(live_state.producer_epoch)]) == 1
        assert "holds this transaction open" in capsys.readouterr().err
        live.abort_transaction()
    finally:
        live.close()
    assert txns([*bootstrap, "find-hanging", "--broker-id", "0", "--max-transaction-timeout", "0"]) == 0
    assert [row.split()[:3] for row in capsys.readouterr().out.splitlines()[1:]] == [
        [topic, "0", str(producer_id)], [topic, "1", str(producer_id)]]
    # A wrong epoch or a producer with nothing open is refused with the reason, and changes nothing.
    assert txns([*bootstrap, "abort", "--topic", topic, "--partition", "0", "--producer-id", str(producer_id),
                 "--producer-epoch", str(epoch + 1)]) == 1
    assert "another epoch" in capsys.readouterr().err
    # The lost transactional id is no help (the tool of before), the partition's producer is.
    assert txns([*bootstrap, "abort", "prepared"]) == 1
    assert "TRANSACTIONAL_ID_NOT_FOUND" in capsys.readouterr().err
    for partition in (0, 1):
        assert txns([*bootstrap, "abort", "--topic", topic, "--partition", str(partition), "--producer-id",
                     str(producer_id), "--producer-epoch", str(epoch)]) == 0
        assert f"aborted the transaction of producer {producer_id}" in capsys.readouterr().out
    assert txns([*bootstrap, "abort", "--topic", topic, "--partition", "0", "--producer-id", str(producer_id),
                 "--producer-epoch", str(epoch)]) == 1
    assert "no transaction open" in capsys.readouterr().err
    assert read_committed(broker.bootstrap, topic, 2) == {0: [b"before-0"], 1: [b"before-1"]}
    assert txns([*bootstrap, "find-hanging", "--max-transaction-timeout", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == []


@pytest.mark.parametrize("args, message", [
    (["abort"], "give a transactional id"),
    (["abort", "x", "--topic", "t"], "not both"),
    (["abort", "--topic", "t", "--partition", "0"], "all of --topic"),
    (["find-hanging", "--partition", "0"], "--partition needs --topic"),
    (["find-hanging", "--max-transaction-timeout", "-1"], "at least 0 minutes"),
    (["find-hanging", "--max-transaction-timeout", "nan"], "at least 0 minutes"),
])
def test_txns_refuses_incomplete_abort_and_find_hanging_options(broker, args, message, capsys):
    assert txns(["--bootstrap-server", broker.bootstrap, "--timeout", "5", *args]) == 1
    assert message in capsys.readouterr().err


def test_describe_producers_and_write_txn_markers_are_advertised(broker):
    conn = Connection("127.0.0.1", broker.port)
    try:
        assert conn.version(61, 0) == 0
        assert conn.version(27, 2) == 2 and conn.version(27, 1) == 1
    finally:
        conn.close()


def test_a_known_producers_transaction_whose_marker_was_lost_is_left_to_the_operator(broker_factory, tmp_path,
                                                                                     topic, caplog):
    # Review finding 4: T1 of "known" commits on both partitions, T2 of the same producer id on
    # partition 1 only; partition 0 loses T1's COMMIT marker. At restart the coordinator no longer
    # records T1's outcome there: aborting it would drop committed records, so it must not.
    data = tmp_path / "data"
    broker = broker_factory(data_dir=data)
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 2})
    commit(broker.bootstrap, "known", topic, {0: b"t1-0", 1: b"t1-1"})
    commit(broker.bootstrap, "known", topic, {1: b"t2-1"})
    broker.stop()
    tear_last_batch(data / f"{topic}-0")  # T1's COMMIT marker
    with caplog.at_level(logging.WARNING, "twophase.broker.txn"):
        again = broker_factory(data_dir=data, transaction_max_timeout_ms=1000, transaction_check_interval_ms=50)
        with Admin(again.bootstrap) as admin:
            [known] = admin.describe_transactions(["known"])
        assert open_transactions(again.bootstrap, topic) == {(topic, 0): [known.producer_id], (topic, 1): []}
        # A transaction begun after the start times out after the hanging one's deadline: once the
        # coordinator has aborted it, its sweep has passed that deadline too.
        with Producer(again.bootstrap, transactional_id="later", transaction_timeout_ms=1000) as later:
            later.init_transactions()
            later.begin_transaction()
            later.send(topic, b"later", partition=1)
            later.flush()

            def later_aborted() -> bool:
                with Admin(again.bootstrap) as admin:
                    return admin.describe_transactions(["later"])[0].state == "CompleteAbort"
            wait_until(later_aborted, what="the coordinator aborting the timed-out transaction of 'later'")
    assert open_transactions(again.bootstrap, topic) == {(topic, 0): [known.producer_id], (topic, 1): []}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"{topic}-0: open transaction of producer {known.producer_id}" in errors[0], errors
    assert "twophase txns find-hanging / abort --topic" in errors[0]
    # The ERROR's advice works: the operator's abort of it is not refused.
    with Admin(again.bootstrap) as admin:
        [state] = [s for s in admin.describe_producers([(topic, 0)])[(topic, 0)] if s.txn_start_offset is not None]
        admin.abort_hanging(topic, 0, state.producer_id, state.producer_epoch)
    assert open_transactions(again.bootstrap, topic) == {(topic, 0): [], (topic, 1): []}
