"""The transactional APIs at the wire level (kio request objects over a socket): versions, error
codes per version, a retried InitProducerId and an exhausted epoch (KIP-360), produce checks,
require_stable, list/describe, and a KIP-939 prepared transaction that survives a broker restart and
a long idle period, then is committed by a fresh connection."""

from __future__ import annotations

import dataclasses
import os
import time

from kio.schema.errors import ErrorCode

from tests.waiting import wait_until
from twophase.broker.txn import TXN_DIR, TransactionLog, TxnMetadata
from twophase.broker.txn.metadata import MAX_EPOCH

from .batches import batch
from .conftest import MS, WireClient, produce_request, req, sub
from .test_txn_interop import END, create_topics, read_confluent, write_end_markers

PARTITIONS = 3


def init_pid(w, tid, *, version=6, timeout_ms=60_000, **fields):
    fields = {"producer_id": -1, "producer_epoch": -1, **fields}
    return w.request(req(22, version, transactional_id=tid, transaction_timeout=timeout_ms * MS, **fields))


def add_partitions(w, tid, pid, epoch, partitions: dict[str, list[int]], version=3):
    topics = tuple(sub(24, version, "AddPartitionsToTxnTopic", name=t, partitions=tuple(ps))
                   for t, ps in partitions.items())
    r = w.request(req(24, version, v3_and_below_transactional_id=tid, v3_and_below_producer_id=pid,
                      v3_and_below_producer_epoch=epoch, v3_and_below_topics=topics))
    return {(t.name, p.partition_index): p.partition_error_code for t in r.results_by_topic_v3_and_below
            for p in t.results_by_partition}


def end_txn(w, tid, pid, epoch, commit, version=4):
    return w.request(req(26, version, transactional_id=tid, producer_id=pid, producer_epoch=epoch,
                         committed=commit)).error_code


def produce_txn(w, tid, topic, partition, pid, epoch, seq, values=(b"v",), transactional=True):
    request = dataclasses.replace(produce_request(topic, batch(list(values), producer_id=pid, producer_epoch=epoch,
                                                               base_sequence=seq, transactional=transactional),
                                                  partition), transactional_id=tid)
    [t] = w.request(request).responses
    return t.partition_responses[0].error_code


def txn_offset_commit(w, tid, pid, epoch, group, topic, offsets: dict[int, int], version=3):
    parts = tuple(sub(28, version, "TxnOffsetCommitRequestPartition", partition_index=p, committed_offset=o,
                      committed_leader_epoch=-1, committed_metadata="") for p, o in offsets.items())
    r = w.request(req(28, version, transactional_id=tid, group_id=group, producer_id=pid, producer_epoch=epoch,
                      generation_id=-1, member_id="", group_instance_id=None,
                      topics=(sub(28, version, "TxnOffsetCommitRequestTopic", name=topic, partitions=parts),)))
    return {p.partition_index: p.error_code for t in r.topics for p in t.partitions}


def offset_fetch(w, group, topic, partitions, require_stable):
    r = w.request(req(9, 7, group_id=group, require_stable=require_stable,
                      topics=(sub(9, 7, "OffsetFetchRequestTopic", name=topic, partition_indexes=tuple(partitions)),)))
    return {p.partition_index: (p.error_code, p.committed_offset) for t in r.topics for p in t.partitions}


def test_api_versions_advertise_the_transactional_apis(wire):
    r = wire().request(req(18, 3, client_software_name="t", client_software_version="1"))
    ranges = {a.api_key: (a.min_version, a.max_version) for a in r.api_keys}
    assert {k: ranges[k] for k in (22, 24, 25, 26, 28, 65, 66)} == {
        22: (0, 6), 24: (0, 3), 25: (0, 3), 26: (0, 4), 28: (0, 3), 65: (0, 0), 66: (0, 2)}


def test_init_producer_id_refusals(broker_factory):
    b = broker_factory(transaction_max_timeout_ms=10_000, transaction_two_phase_commit=False)
    w = WireClient(b.port)
    try:
        assert init_pid(w, "").error_code == ErrorCode.invalid_request
        assert init_pid(w, "t", timeout_ms=10_001).error_code == ErrorCode.invalid_transaction_timeout
        assert init_pid(w, "t", enable2_pc=True).error_code == ErrorCode.transactional_id_authorization_failed
        ok = init_pid(w, "t", timeout_ms=10_000, version=0)
        assert ok.error_code == ErrorCode.none and ok.producer_epoch == 0
        plain = init_pid(w, None)
        assert plain.error_code == ErrorCode.none and plain.producer_id != ok.producer_id
    finally:
        w.close()


def test_fencing_is_spelled_per_version(broker, wire, topic):
    create_topics(broker.bootstrap, topic)
    w = wire()
    old = init_pid(w, "f")
    new = init_pid(w, "f")
    assert (new.producer_id, new.producer_epoch) == (old.producer_id, old.producer_epoch + 1)
    pid, stale = old.producer_id, old.producer_epoch
    assert end_txn(w, "f", pid, stale, True, version=1) == ErrorCode.invalid_producer_epoch
    assert end_txn(w, "f", pid, stale, True, version=2) == ErrorCode.producer_fenced
    assert add_partitions(w, "f", pid, stale, {topic: [0]}, version=1) == {(topic, 0): ErrorCode.invalid_producer_epoch}
    assert add_partitions(w, "f", pid, stale, {topic: [0]}, version=3) == {(topic, 0): ErrorCode.producer_fenced}
    retry = dict(producer_id=pid, producer_epoch=stale)
    assert init_pid(w, "f", version=3, **retry).error_code == ErrorCode.invalid_producer_epoch
    assert init_pid(w, "f", version=4, **retry).error_code == ErrorCode.producer_fenced


def test_init_retried_after_a_lost_answer_gets_the_same_epoch(broker_factory, tmp_path):
    data_dir = tmp_path / "d"
    b = broker_factory(data_dir=data_dir)
    w = WireClient(b.port)
    first = init_pid(w, "r")
    pid, epoch = first.producer_id, first.producer_epoch
    bumped = init_pid(w, "r", version=4, producer_id=pid, producer_epoch=epoch)
    assert (bumped.error_code, bumped.producer_id, bumped.producer_epoch) == (ErrorCode.none, pid, epoch + 1)
    w.close()
    b.stop()  # the answer "was lost"; the retry reaches a restarted broker
    b = broker_factory(data_dir=data_dir)
    w = WireClient(b.port)
    try:
        retried = init_pid(w, "r", version=4, producer_id=pid, producer_epoch=epoch)
        assert (retried.error_code, retried.producer_id, retried.producer_epoch) == (ErrorCode.none, pid, epoch + 1)
        assert init_pid(w, "r", version=4, producer_id=pid, producer_epoch=epoch + 1).producer_epoch == epoch + 2
        older = init_pid(w, "r", version=4, producer_id=pid, producer_epoch=epoch)  # older than the previous
        assert (older.error_code, older.producer_id, older.producer_epoch) == (ErrorCode.producer_fenced, -1, -1)
    finally:
        w.close()


def test_an_exhausted_epoch_gets_a_new_producer_id(broker_factory, tmp_path, topic):
    data_dir = tmp_path / "d"
    b = broker_factory(data_dir=data_dir)
    w = WireClient(b.port)
    old_pid = init_pid(w, "x").producer_id
    w.close()
    b.stop()
    log = TransactionLog(os.path.join(data_dir, TXN_DIR))  # no test waits for 32766 bumps
    meta = TxnMetadata.from_dict("x", log.open()["x"])
    meta.producer_epoch = MAX_EPOCH - 1
    log.append("x", meta.to_dict())
    log.close()
    b = broker_factory(data_dir=data_dir)
    create_topics(b.bootstrap, topic)
    w = WireClient(b.port)
    try:
        rotated = init_pid(w, "x", version=4, producer_id=old_pid, producer_epoch=MAX_EPOCH - 1)
        assert rotated.error_code == ErrorCode.none
        new_pid = rotated.producer_id
        assert new_pid != old_pid and rotated.producer_epoch == 0
        retried = init_pid(w, "x", version=4, producer_id=old_pid, producer_epoch=MAX_EPOCH - 1)
        assert (retried.error_code, retried.producer_id, retried.producer_epoch) == (ErrorCode.none, new_pid, 0)
        assert init_pid(w, "x", version=4, producer_id=old_pid, producer_epoch=MAX_EPOCH - 2).error_code == \
            ErrorCode.producer_fenced
        # The new id works for a transaction; the old one is refused.
        assert add_partitions(w, "x", old_pid, MAX_EPOCH - 1, {topic: [0]}) == {
            (topic, 0): ErrorCode.invalid_producer_id_mapping}
        assert add_partitions(w, "x", new_pid, 0, {topic: [0]}) == {(topic, 0): ErrorCode.none}
        assert produce_txn(w, "x", topic, 0, new_pid, 0, 0, (b"after-rotation",)) == ErrorCode.none
        assert end_txn(w, "x", new_pid, 0, True) == ErrorCode.none
    finally:
        w.close()
    write_end_markers(b.bootstrap, [topic])
    assert read_confluent(b.bootstrap, [topic], "read_committed") == [b"after-rotation"]


def test_add_partitions_names_the_unknown_ones(broker, wire, topic):
    create_topics(broker.bootstrap, topic)
    w = wire()
    r = init_pid(w, "u")
    codes = add_partitions(w, "u", r.producer_id, r.producer_epoch, {topic: [0, PARTITIONS], "no-such-topic": [0]})
    assert codes == {(topic, 0): ErrorCode.operation_not_attempted,
                     (topic, PARTITIONS): ErrorCode.unknown_topic_or_partition,
                     ("no-such-topic", 0): ErrorCode.unknown_topic_or_partition}
    assert broker.call(lambda: broker.transactions.describe("u").state) == "Empty"  # nothing was added


def test_produce_only_into_the_open_transaction(broker, wire, topic):
    create_topics(broker.bootstrap, topic)
    w = wire()
    r = init_pid(w, "p")
    pid, epoch = r.producer_id, r.producer_epoch
    assert produce_txn(w, "p", topic, 0, pid, epoch, 0) == ErrorCode.invalid_txn_state  # not added
    assert add_partitions(w, "p", pid, epoch, {topic: [0]}) == {(topic, 0): ErrorCode.none}
    assert produce_txn(w, "p", topic, 0, pid, epoch, 0, transactional=False) == ErrorCode.invalid_record
    assert produce_txn(w, "p", topic, 1, pid, epoch, 0) == ErrorCode.invalid_txn_state
    assert produce_txn(w, "p", topic, 0, pid, epoch, 0) == ErrorCode.none
    assert end_txn(w, "p", pid, epoch, True) == ErrorCode.none
    assert end_txn(w, "p", pid, epoch, True) == ErrorCode.none  # retried
    assert end_txn(w, "p", pid, epoch, False) == ErrorCode.invalid_txn_state
    assert produce_txn(w, "p", topic, 0, pid, epoch, 1) == ErrorCode.invalid_txn_state  # late, after the end


def test_a_transactional_batch_without_a_transactional_id_is_refused(broker, wire, topic):
    """Otherwise it would open a transaction no coordinator knows of: the LSO would stay there forever."""
    create_topics(broker.bootstrap, topic)
    w = wire()
    pid = init_pid(w, None, version=4).producer_id
    records = batch([b"stray"], producer_id=pid, producer_epoch=0, base_sequence=0, transactional=True)
    [partition] = w.request(produce_request(topic, records)).responses[0].partition_responses
    assert partition.error_code == ErrorCode.invalid_record
    plog = broker.partition_log(topic, 0)
    assert broker.call(lambda: (plog.high_watermark, plog.last_stable_offset)) == (0, 0)


def test_offset_fetch_require_stable_waits_for_the_transaction(broker, wire, topic):
    create_topics(broker.bootstrap, topic)
    w = wire()
    r = init_pid(w, "o")
    pid, epoch = r.producer_id, r.producer_epoch
    assert txn_offset_commit(w, "o", pid, epoch, "grp", topic, {0: 5}) == {0: ErrorCode.invalid_txn_state}
    assert w.request(req(25, 3, transactional_id="o", producer_id=pid, producer_epoch=epoch,
                         group_id="grp")).error_code == ErrorCode.none
    assert txn_offset_commit(w, "o", pid, epoch, "grp", topic, {0: 5, 1: 6}) == {0: ErrorCode.none, 1: ErrorCode.none}
    assert offset_fetch(w, "grp", topic, [0, 2], True) == {0: (ErrorCode.unstable_offset_commit, -1),
                                                           2: (ErrorCode.none, -1)}
    assert offset_fetch(w, "grp", topic, [0], False) == {0: (ErrorCode.none, -1)}
    assert end_txn(w, "o", pid, epoch, True) == ErrorCode.none
    assert offset_fetch(w, "grp", topic, [0, 1], True) == {0: (ErrorCode.none, 5), 1: (ErrorCode.none, 6)}


def test_list_and_describe(broker, wire, topic):
    create_topics(broker.bootstrap, topic)
    w = wire()
    r = init_pid(w, "listed", timeout_ms=45_000)
    add_partitions(w, "listed", r.producer_id, r.producer_epoch, {topic: [2, 0]})
    init_pid(w, "idle")
    listed = w.request(req(66, 1, state_filters=("Ongoing", "Nope"), producer_id_filters=(), duration_filter=-1))
    assert [(s.transactional_id, s.producer_id, s.transaction_state) for s in listed.transaction_states] == [
        ("listed", r.producer_id, "Ongoing")]
    assert listed.unknown_state_filters == ("Nope",)
    bad = w.request(req(66, 2, state_filters=(), producer_id_filters=(), duration_filter=-1,
                        transactional_id_pattern="["))
    assert bad.error_code == ErrorCode.invalid_regular_expression
    [d, missing] = w.request(req(65, 0, transactional_ids=("listed", "ghost"))).transaction_states
    assert (d.error_code, d.transaction_state, d.producer_id, d.producer_epoch) == (
        ErrorCode.none, "Ongoing", r.producer_id, r.producer_epoch)
    assert d.transaction_timeout.total_seconds() == 45
    assert [(t.topic, t.partitions) for t in d.topics] == [(topic, (0, 2))]
    assert abs(d.transaction_start_time.timestamp() - time.time()) < 60
    assert missing.error_code == ErrorCode.transactional_id_not_found


def test_prepared_transaction_survives_restart_and_idle_then_a_fresh_connection_commits(broker_factory, tmp_path,
                                                                                        topic):
    settings = dict(data_dir=tmp_path / "d", transaction_max_timeout_ms=1_000, transaction_check_interval_ms=50)
    b = broker_factory(**settings)
    topics = [topic + "-x", topic + "-y"]
    create_topics(b.bootstrap, *topics)
    w = WireClient(b.port)
    prepared = init_pid(w, "two-phase", timeout_ms=1_000, enable2_pc=True)
    ordinary = init_pid(w, "ordinary", timeout_ms=1_000)
    for tid, r, values in (("two-phase", prepared, (b"kept-1", b"kept-2")), ("ordinary", ordinary, (b"lost",))):
        assert set(add_partitions(w, tid, r.producer_id, r.producer_epoch, {t: [0, 1] for t in topics}).values()) == {
            ErrorCode.none}
        for t in topics:
            for p in (0, 1):
                assert produce_txn(w, tid, t, p, r.producer_id, r.producer_epoch, 0, values) == ErrorCode.none
    w.close()
    b.stop()
    b = broker_factory(**settings)
    # Idle for longer than the ordinary timeout: the ordinary transaction is aborted, the prepared one stays.
    wait_until(lambda: b.call(lambda: b.transactions.describe("ordinary").state) == "CompleteAbort",
               timeout=60, what="the ordinary transaction to time out")
    assert b.call(lambda: b.transactions.describe("two-phase").state) == "Ongoing"
    assert b.call(lambda: b.logs.partition(topics[0], 0).last_stable_offset) == 0  # still held back
    fresh = WireClient(b.port)
    try:
        takeover = init_pid(fresh, "two-phase", timeout_ms=1_000, enable2_pc=True, keep_prepared_txn=True)
        assert takeover.error_code == ErrorCode.none
        assert (takeover.ongoing_txn_producer_id, takeover.ongoing_txn_producer_epoch) == (
            prepared.producer_id, prepared.producer_epoch)
        assert (takeover.producer_id, takeover.producer_epoch) == (prepared.producer_id, prepared.producer_epoch + 1)
        assert end_txn(fresh, "two-phase", takeover.producer_id, takeover.producer_epoch, True) == ErrorCode.none
    finally:
        fresh.close()
    write_end_markers(b.bootstrap, topics, **{"transaction.timeout.ms": 1_000})
    seen = read_confluent(b.bootstrap, topics, "read_committed")
    assert sorted(seen) == sorted([b"kept-1", b"kept-2"] * 4)
    assert END not in seen


def test_cli_flags_reach_the_broker_config(tmp_path):
    import argparse

    from twophase.broker.cli import _config, configure_parser

    parse = configure_parser(argparse.ArgumentParser()).parse_args
    default = _config(parse(["--data-dir", str(tmp_path)]))
    assert default.transaction_two_phase_commit and default.transaction_max_timeout_ms == 900_000
    forbidding = _config(parse(["--data-dir", str(tmp_path), "--no-two-phase-commit",
                                "--transaction-max-timeout-ms", "5000", "--transactional-id-expiration-ms", "60000"]))
    assert not forbidding.transaction_two_phase_commit
    assert (forbidding.transaction_max_timeout_ms, forbidding.transactional_id_expiration_ms) == (5000, 60000)
