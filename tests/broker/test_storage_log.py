"""PartitionLog and Segment: offsets, rolling, index, retention, flushing, recovery, timestamps."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct

import pytest

import twophase.broker.storage.segment as segment_module
from twophase.broker.storage import LogConfig, PartitionLog
from twophase.broker.storage.segment import Segment, index_path
from twophase.wire.errors import (
    CorruptRecordError,
    InvalidRecordError,
    KafkaStorageError,
    MessageTooLargeError,
    OffsetOutOfRangeError,
)
from twophase.wire.records import control_batch, iter_batches

from .batches import batch, batch_offsets, decode, kafka_batch

SMALL = LogConfig(segment_bytes=2048, index_interval_bytes=256)


def values(n: int, size: int = 20, prefix: str = "v") -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(size, b".") for i in range(n)]


def fill(log: PartitionLog, batches: int, per_batch: int = 3, now_ms: int = 0) -> list[bytes]:
    written = []
    for b in range(batches):
        vals = values(per_batch, prefix=f"b{b}-")
        log.append(batch(vals, timestamp=1000 + 10 * b), now_ms)
        written.extend(vals)
    return written


def read_all(log: PartitionLog, start: int | None = None) -> list[tuple[int, int, bytes | None, bytes | None]]:
    out = []
    offset = log.log_start_offset if start is None else start
    while offset < log.high_watermark:
        data = log.read(offset, 1000)
        assert data
        records = [r for r in decode(data) if r[0] >= offset]
        out.extend(records)
        offset = batch_offsets(data)[-1][1] + 1
    return out


def test_append_read_round_trip(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    assert (log.log_start_offset, log.high_watermark) == (0, 0)
    r1 = log.append(batch([b"a", b"b"], keys=[b"k1", None]), now_ms=0)
    r2 = log.append(batch([b"c"]), now_ms=0)
    assert (r1.base_offset, r1.last_offset, r1.duplicate, r1.log_append_time) == (0, 1, False, -1)
    assert (r2.base_offset, r2.last_offset) == (2, 2)
    assert log.high_watermark == 3
    data = log.read(0, 1 << 20)
    assert [(o, k, v) for o, _, k, v in decode(data)] == [(0, b"k1", b"a"), (1, None, b"b"), (2, None, b"c")]
    assert all(h.leader_epoch == -1 for _, h in iter_batches(data))
    assert log.read(3, 100) == b""
    log.close()


def test_multi_batch_append_assigns_consecutive_offsets(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"x"]), 0)
    result = log.append(batch([b"a", b"b"]) + batch([b"c"]) + kafka_batch([b"d" * 300] * 2, compression=1), 0)
    assert (result.base_offset, result.last_offset) == (1, 5)
    assert batch_offsets(log.read(1, 1 << 20)) == [(1, 2), (3, 3), (4, 5)]
    assert [v for _, _, _, v in decode(log.read(0, 1 << 20))] == [b"x", b"a", b"b", b"c", b"d" * 300, b"d" * 300]


def stamped(data: bytes, base_offset: int, leader_epoch: int) -> bytes:
    """``data`` as the log must store it: per batch, baseOffset and partitionLeaderEpoch rewritten, nothing else."""
    out = bytearray()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from(">i", data, pos + 8)
        (last_offset_delta,) = struct.unpack_from(">i", data, pos + 23)
        out += struct.pack(">q", base_offset) + data[pos + 8 : pos + 12] + struct.pack(">i", leader_epoch)
        out += data[pos + 16 : pos + 12 + length]
        base_offset += last_offset_delta + 1
        pos += 12 + length
    return bytes(out)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_append_rewrites_only_offsets_and_epoch_and_leaves_the_callers_buffer_alone(tmp_path, kind):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, leader_epoch=7)
    first = batch([b"x"], base_offset=1234)  # whatever base offset a client sends is replaced
    request = batch([b"a", b"b"], base_offset=99) + kafka_batch([b"d" * 300] * 3, compression=1) + batch([b"c"])
    # A memoryview in the middle of a larger buffer, like a slice of a received request frame.
    frame = bytearray(b"\x00" * 5 + request + b"\xff" * 3)
    frame_before = bytes(frame)
    arg = {"bytes": request, "bytearray": frame[5:-3], "memoryview": memoryview(frame)[5:-3]}[kind]
    arg_before = bytes(arg)
    assert log.append(first, 0).base_offset == 0
    result = log.append(arg, 0)
    assert (result.base_offset, result.last_offset) == (1, 6)
    assert bytes(arg) == arg_before and bytes(frame) == frame_before

    expected = stamped(first, 0, 7) + stamped(request, 1, 7)
    data = log.read(0, 1 << 20)
    assert data == expected
    assert [(h.base_offset, h.last_offset, h.leader_epoch) for _, h in iter_batches(data)] == [
        (0, 0, 7), (1, 2, 7), (3, 5, 7), (6, 6, 7)]  # iter_batches also checks every CRC
    assert [v for _, _, _, v in decode(data)] == [b"x", b"a", b"b", b"d" * 300, b"d" * 300, b"d" * 300, b"c"]
    log.close()
    assert PartitionLog(path).read(0, 1 << 20) == expected  # recovery re-checks CRCs and offsets


@pytest.mark.parametrize("iov_max", [3, None])
def test_append_of_more_batches_than_one_writev_takes(tmp_path, monkeypatch, iov_max):
    if iov_max is not None:  # 3 buffers per call: a batch's head and rest land in different calls
        monkeypatch.setattr(segment_module, "_IOV_MAX", iov_max)
    count = segment_module._IOV_MAX // 2 + 3  # two buffers per batch
    request = b"".join(batch([b"v%d" % i]) for i in range(count))
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    log.append(batch([b"first"]), 0)
    result = log.append(request, 0)
    assert (result.base_offset, result.last_offset) == (1, count)
    assert log.read_range(1, 1 << 30)[0] == stamped(request, 1, -1)


def test_short_write_leaves_the_segment_as_it_was(tmp_path, monkeypatch):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    first = batch([b"kept"])
    log.append(first, 0)
    size_before = os.path.getsize(log.segments[0].path)
    monkeypatch.setattr(segment_module, "_IOV_MAX", 4)
    real_writev = os.writev
    calls = []

    def short_second_writev(fd, buffers):
        calls.append(len(buffers))
        if len(calls) == 2:
            return real_writev(fd, buffers[:1])  # the kernel wrote only part of the second group
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", short_second_writev)
    with pytest.raises(KafkaStorageError, match="short write"):
        log.append(b"".join(batch([b"lost%d" % i]) for i in range(4)), 0)
    assert calls == [4, 4]
    assert os.path.getsize(log.segments[0].path) == size_before  # the first group was truncated away too
    monkeypatch.undo()
    # A short write means the disk is full; it was undone, so the log stays online and the next append works.
    after = batch([b"after"])
    assert log.append(after, 0).base_offset == 1
    reopened = PartitionLog(path)
    assert reopened.high_watermark == 2
    assert reopened.read(0, 1 << 20) == stamped(first, 0, -1) + stamped(after, 1, -1)


def test_read_starts_at_containing_batch_and_returns_at_least_one(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch(values(5)), 0)
    log.append(batch(values(5)), 0)
    data = log.read(3, 1)  # max_bytes smaller than one batch
    assert batch_offsets(data) == [(0, 4)]
    assert batch_offsets(log.read(5, 1 << 20)) == [(5, 9)]
    first = len(log.read(0, 1))
    assert batch_offsets(log.read(0, first + 10)) == [(0, 4)]  # second batch does not fit whole
    assert batch_offsets(log.read(0, 1 << 20, upper_offset=5)) == [(0, 4)]
    assert log.read(5, 1 << 20, upper_offset=5) == b""


def test_read_out_of_range(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"a"]), 0)
    with pytest.raises(OffsetOutOfRangeError) as info:
        log.read(2, 100)
    assert info.value.code == 1
    with pytest.raises(OffsetOutOfRangeError):
        log.read(-1, 100)


def test_segment_roll_and_read_across_segments(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    written = fill(log, 40)
    assert len(log.segments) > 3
    bases = [s.base_offset for s in log.segments]
    assert bases == sorted(bases) and bases[0] == 0
    assert all(s.size <= SMALL.segment_bytes for s in log.segments)
    names = sorted(os.listdir(tmp_path / "t-0"))
    assert f"{bases[1]:020d}.log" in names and f"{bases[1]:020d}.index" in names
    assert [v for _, _, _, v in read_all(log)] == written
    # One big read spans segments without skipping offsets.
    data = log.read(0, 1 << 20)
    assert [r[0] for r in decode(data)] == list(range(len(written)))
    # A budget that ends inside a segment never continues into the next one.
    for max_bytes in (100, 700, 1500, 2500):
        offsets = [r[0] for r in decode(log.read(0, max_bytes))]
        assert offsets == list(range(len(offsets)))


def test_index_lookup_from_every_offset(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(index_interval_bytes=200))
    fill(log, 30)
    segment = log.segments[0]
    entries = segment.index_entries()
    assert len(entries) > 5
    for rel, pos, _ in entries:
        assert segment.find_position(rel) == pos
    for offset in range(log.high_watermark):
        (base, last), *_ = batch_offsets(log.read(offset, 1))
        assert base <= offset <= last


def test_index_rebuilt_when_missing_or_corrupt(tmp_path, caplog):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, SMALL)
    written = fill(log, 40)
    first = log.segments[0]
    expected_entries = first.index_entries()
    log.close()
    idx = index_path(path, 0)
    os.unlink(idx)
    with open(index_path(path, log.segments[1].base_offset), "r+b") as f:
        f.write(b"\xff" * 16)  # an entry pointing nowhere
    reopened = PartitionLog(path, SMALL)
    assert reopened.segments[0].index_entries() == expected_entries
    assert [v for _, _, _, v in read_all(reopened)] == written
    assert "rebuilding" in caplog.text


def test_crc_mismatch_rejects_whole_append(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"ok"]), 0)
    bad = bytearray(batch([b"corrupt me"]))
    bad[-3] ^= 0x01
    with pytest.raises(CorruptRecordError) as info:
        log.append(batch([b"good"]) + bytes(bad), 0)
    assert info.value.code == 2
    assert log.high_watermark == 1
    assert [v for _, _, _, v in decode(log.read(0, 1 << 20))] == [b"ok"]


@pytest.mark.parametrize(
    "records, error",
    [
        (b"", InvalidRecordError),
        (control_batch(1, 0, True, 0, 0), InvalidRecordError),  # clients may not write markers
        (batch([b"a"], producer_id=5, producer_epoch=0, base_sequence=-1), InvalidRecordError),
        (batch([b"x" * 2000]), MessageTooLargeError),
    ],
)
def test_invalid_appends(tmp_path, records, error):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(max_message_bytes=1024))
    with pytest.raises(error):
        log.append(records, 0)
    assert log.high_watermark == 0


def test_inconsistent_record_count_rejected(tmp_path):
    import crc32c

    data = bytearray(batch([b"a", b"b"]))
    struct.pack_into(">i", data, 57, 5)  # recordCount no longer matches lastOffsetDelta
    struct.pack_into(">I", data, 17, crc32c.crc32c(bytes(data[21:])))
    log = PartitionLog(str(tmp_path / "t-0"))
    with pytest.raises(InvalidRecordError) as info:
        log.append(bytes(data), 0)
    assert info.value.code == 87


def test_coordinator_may_append_control_batches(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    result = log.append(control_batch(1, 0, True, 0, 5), 0, from_client=False)
    assert (result.base_offset, result.last_offset) == (0, 0)


@pytest.mark.parametrize("cut", [1, 13, 40, 61, 70])
def test_torn_tail_truncated_on_reopen(tmp_path, caplog, cut):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    written = fill(log, 5)
    size_before = log.segments[-1].size
    last = batch([b"torn"])
    log.append(last, 0)
    # No close(): the process "dies" with half of the last batch on disk.
    seg_file = log.segments[-1].path
    os.truncate(seg_file, size_before + min(cut, len(last) - 1))
    with caplog.at_level(logging.WARNING):
        reopened = PartitionLog(path)
    assert reopened.high_watermark == 15
    assert os.path.getsize(seg_file) == size_before
    assert [v for _, _, _, v in read_all(reopened)] == written
    assert "offset 15" in caplog.text and f"dropping {min(cut, len(last) - 1)} bytes" in caplog.text
    assert reopened.append(batch([b"after"]), 0).base_offset == 15


def test_garbage_tail_truncated_on_reopen(tmp_path, caplog):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    written = fill(log, 5)
    log.close()
    with open(log.segments[-1].path, "ab") as f:
        f.write(os.urandom(500))
    reopened = PartitionLog(path)
    assert reopened.high_watermark == 15
    assert [v for _, _, _, v in read_all(reopened)] == written
    assert "dropping 500 bytes" in caplog.text


@pytest.mark.parametrize("where", ["records", "length"])
def test_a_damaged_batch_in_the_middle_of_the_active_segment_keeps_the_batches_after_it(tmp_path, where):
    """A flipped byte is not a torn tail: the acknowledged batches after it are kept and their offsets stay
    taken. Only the damaged batch is refused if its framing holds (records), else everything from it on
    (length), and new batches then go to a clean segment. Before, recovery truncated the segment at the
    damaged batch."""
    path = str(tmp_path / "t-0")
    log = PartitionLog(path)
    written = fill(log, 5)
    positions = [pos for pos, _ in iter_batches(log.read(0, 1 << 20))]
    log.close()
    size = os.path.getsize(log.segments[-1].path)
    with open(log.segments[-1].path, "r+b") as f:
        # inside batch 3's records (CRC mismatch), or its length (its framing broken too)
        f.seek(positions[3] + (70 if where == "records" else 10))
        f.write(b"\x00\xff")
    reopened = PartitionLog(path)
    try:
        assert os.path.getsize(reopened.segments[-1].path) == size and reopened.log_end_offset == 15
        assert [v for _, _, _, v in decode(reopened.read(0, 1 << 20))] == written[:9]
        with pytest.raises(CorruptRecordError):
            reopened.read(9, 1 << 20)
        if where == "records":
            assert [v for _, _, _, v in decode(reopened.read(12, 1 << 20))] == written[12:]
        else:
            with pytest.raises(CorruptRecordError):
                reopened.read(12, 1 << 20)
        assert reopened.append(batch([b"a"]), 0).base_offset == 15
        assert len(reopened.segments) == (1 if where == "records" else 2)
        assert [v for _, _, _, v in decode(reopened.read(15, 1 << 20))] == [b"a"]
    finally:
        reopened.close()


def test_recovery_after_crash_keeps_all_segments(tmp_path):
    path = str(tmp_path / "t-0")
    log = PartitionLog(path, SMALL)
    written = fill(log, 40)
    # No close(): simulate kill -9 (data was fsynced per append, index of the active segment is lost).
    reopened = PartitionLog(path, SMALL)
    assert reopened.high_watermark == len(written)
    assert [v for _, _, _, v in read_all(reopened)] == written


def test_retention_by_size(tmp_path):
    config = LogConfig(segment_bytes=2048, index_interval_bytes=256, retention_bytes=4096)
    log = PartitionLog(str(tmp_path / "t-0"), config)
    written = fill(log, 60)
    assert log.log_start_offset > 0  # already enforced on roll
    log.enforce_retention(now_ms=0)
    assert log.size_bytes - log.segments[0].size < 4096 <= log.size_bytes
    start = log.log_start_offset
    assert start == log.segments[0].base_offset
    assert [v for _, _, _, v in read_all(log)] == written[start:]
    with pytest.raises(OffsetOutOfRangeError):
        log.read(start - 1, 100)
    assert not os.path.exists(os.path.join(log.directory, f"{0:020d}.log"))


def test_retention_by_time(tmp_path):
    config = LogConfig(segment_bytes=2048, index_interval_bytes=256, retention_ms=1000)
    log = PartitionLog(str(tmp_path / "t-0"), config)
    for i in range(30):  # record timestamps 0, 100, ... 2900 (old ones roll into early segments)
        log.append(batch(values(3), timestamp=i * 100), 0)
    segments_before = len(log.segments)
    deleted = log.enforce_retention(now_ms=3000)
    assert 0 < deleted < segments_before
    assert all(3000 - s.max_timestamp <= 1000 for s in log.segments)
    # Everything expired: the log empties but keeps its offsets.
    hw = log.high_watermark
    log.enforce_retention(now_ms=10_000)
    assert (log.log_start_offset, log.high_watermark, log.size_bytes) == (hw, hw, 0)
    assert log.append(batch([b"new"], timestamp=10_000), 0).base_offset == hw
    log.close()
    reopened = PartitionLog(log.directory, config)
    assert (reopened.log_start_offset, reopened.high_watermark) == (hw, hw + 1)


def test_flush_policy_interval(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(segment_module, "_fdatasync", lambda fd: calls.append(fd))
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000), now_ms=0)
    log.append(batch([b"a"]), 0)
    assert calls == []
    sync = log.flush_due(0)  # the first call sets the clock's baseline
    assert sync is not None and calls == []  # detached: nothing is synced until it runs
    sync()
    assert len(calls) == 1
    log.append(batch([b"b"]), 0)
    assert log.flush_due(500) is None
    log.flush_due(1000)()
    assert len(calls) == 2
    assert log.flush_due(2000) is None  # nothing appended since
    always = PartitionLog(str(tmp_path / "t-1"), LogConfig(flush="always"))
    always.append(batch([b"a"]), 0)
    assert len(calls) == 3
    assert always.flush_due(10**12) is None


def test_a_detached_fsync_survives_a_roll_and_close_and_close_still_syncs(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(segment_module, "_fdatasync", lambda fd: synced.append(os.fstat(fd).st_ino))
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000), now_ms=0)
    log.append(batch([b"a"]), 0)
    first_segment = os.stat(os.path.join(log.directory, "00000000000000000000.log")).st_ino
    sync = log.flush_due(0)
    log.roll()
    log.append(batch([b"b"]), 0)
    log.close()  # seals and syncs on its own: it does not count on the detached fsync having run
    before = list(synced)
    sync()  # its descriptor is a duplicate, still valid after the close
    assert synced == before + [first_segment]
    assert first_segment in before


def test_a_failed_detached_fsync_takes_the_log_offline(tmp_path, monkeypatch):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000), now_ms=0)
    log.append(batch([b"a"]), 0)

    def fail(fd):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(segment_module, "_fdatasync", fail)
    sync = log.flush_due(0)
    with pytest.raises(OSError):
        sync()
    log.flush_failed(OSError(errno.EIO, "injected"))
    with pytest.raises(KafkaStorageError):
        log.append(batch([b"b"]), 0)
    assert log.flush_due(10**12) is None


def test_offset_for_timestamp(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), SMALL)
    for i in range(40):
        log.append(batch(values(3), timestamps=[i * 100, i * 100 + 10, i * 100 + 50]), 0)
    assert len(log.segments) > 2
    assert log.offset_for_timestamp(0) == 0
    assert log.offset_for_timestamp(-5) == 0
    assert log.offset_for_timestamp(1005) == 31  # batch 10: 1000, 1010, 1050
    assert log.offset_for_timestamp(1011) == 32
    assert log.offset_for_timestamp(1050) == 32
    assert log.offset_for_timestamp(1051) == 33
    found = log.timestamp_lookup(2222)
    assert (found.offset, found.timestamp) == (68, 2250)  # batch 22: 2200, 2210, 2250
    assert log.offset_for_timestamp(3951) is None
    # Out-of-order timestamps: the first record at or above the target wins.
    other = PartitionLog(str(tmp_path / "t-1"))
    other.append(batch([b"a", b"b"], timestamps=[500, 100]), 0)
    other.append(batch([b"c"], timestamps=[300]), 0)
    assert other.offset_for_timestamp(200) == 0
    assert other.offset_for_timestamp(501) is None


def test_offset_for_timestamp_compressed_batch_answers_its_base(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"a"], timestamp=10), 0)
    log.append(kafka_batch([b"z" * 400] * 3, compression=1, timestamp=100), 0)  # timestamps 100..102
    assert log.offset_for_timestamp(101) == 1


def test_closed_log_refuses_work(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"))
    log.close()
    log.close()
    with pytest.raises(KafkaStorageError):
        log.append(batch([b"a"]), 0)


def test_write_failure_takes_log_offline_until_reopen(tmp_path, monkeypatch):
    import twophase.broker.storage.segment as segment_module

    log = PartitionLog(str(tmp_path / "t-0"))
    log.append(batch([b"a"]), 0)

    def failing(fd):
        raise OSError(5, "EIO")

    monkeypatch.setattr(segment_module, "_fdatasync", failing)
    with pytest.raises(KafkaStorageError):
        log.append(batch([b"b"]), 0)
    with pytest.raises(KafkaStorageError):
        log.read(0, 100)
    monkeypatch.undo()
    reopened = PartitionLog(log.directory)
    assert reopened.high_watermark in (1, 2)


def test_recovery_fsyncs_the_active_segment(tmp_path, monkeypatch):
    # Data a crash left unsynced in the page cache counts as written after a restart (a producer's
    # retry of it is a duplicate), so recovery makes it durable first.
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush="always"))
    log.append(batch([b"appended, never fsynced"]), 0, defer_fsync=True)
    synced = []
    monkeypatch.setattr(segment_module, "_fdatasync", lambda fd: synced.append(os.fstat(fd).st_ino))
    reopened = PartitionLog(log.directory, LogConfig(flush="always"))  # no close(): a crash
    assert reopened.high_watermark == 1
    assert os.stat(os.path.join(log.directory, "00000000000000000000.log")).st_ino in synced


def test_a_failed_detached_fsync_fails_the_next_inline_one_too(tmp_path, monkeypatch):
    # The duplicate shares the open file's writeback-error state: once the worker saw the error, an
    # fsync on the original descriptor may succeed although the pages are lost.
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000), now_ms=0)
    log.append(batch([b"a"]), 0)
    errors = [OSError(errno.EIO, "injected")]

    def sync_once_failing(fd):
        if errors:
            raise errors.pop()

    monkeypatch.setattr(segment_module, "_fdatasync", sync_once_failing)
    with pytest.raises(OSError):
        log.flush_due(0)()
    with pytest.raises(OSError):
        log.flush()  # the device would now say "fine"; the segment remembers it was not


def test_under_an_fsync_interval_a_roll_leaves_the_seal_to_the_flusher(tmp_path, monkeypatch):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024), now_ms=0)
    calls = []
    monkeypatch.setattr(segment_module, "_fdatasync", lambda fd: calls.append(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))  # snapshot, index and directory
    for i in range(12):
        log.append(batch([b"x" * 200]), 0)
    assert len(log.segments) > 1 and calls == []  # rolled, nothing fsynced on the caller's thread
    assert not os.path.exists(index_path(log.directory, 0))  # no index file: not trusted yet
    assert not [n for n in os.listdir(log.directory) if n.endswith(".snapshot")]
    log.flush_due(0)()
    assert os.path.exists(index_path(log.directory, 0)) and calls
    assert [n for n in os.listdir(log.directory) if n.endswith(".snapshot")]


def test_a_crash_before_the_seal_loses_only_the_torn_tail_and_what_follows(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024), now_ms=0)
    while len(log.segments) < 3:
        log.append(batch([b"x" * 200]), 0)
    first, second = log.segments[0], log.segments[1]
    # A crash: the seals never ran, and a page of the first segment's last batch never made it to
    # disk (one byte differs; the framing still looks right, only the CRC tells).
    with open(first.path, "r+b") as f:
        f.seek(first.size - 5)
        byte = f.read(1)
        f.seek(first.size - 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    reopened = PartitionLog(log.directory, LogConfig(flush=1000, segment_bytes=1024))
    assert [s.base_offset for s in reopened.segments] == [0]  # the later ones no longer follow on
    assert reopened.high_watermark == second.base_offset - 1
    assert not os.path.exists(second.path)
    assert [v for _, _, _, v in decode(reopened.read(0, 1 << 20))] == [b"x" * 200] * (second.base_offset - 1)


# -- crashes around a roll under an fsync interval (the flusher seals rolled segments later) -------


def sync_tracker(monkeypatch) -> dict[str, int]:
    """Path -> its size at its last fdatasync: what a power loss keeps of each segment."""
    synced: dict[str, int] = {}
    real = segment_module._fdatasync

    def fdatasync(fd: int) -> None:
        real(fd)
        synced[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_size

    monkeypatch.setattr(segment_module, "_fdatasync", fdatasync)
    return synced


def power_loss(directory: str, synced: dict[str, int]) -> None:
    for name in os.listdir(directory):
        if name.endswith(".log"):
            path = os.path.join(directory, name)
            os.truncate(path, synced.get(path, 0))


def test_a_marker_written_right_after_a_roll_survives_a_power_loss(tmp_path, monkeypatch):
    synced = sync_tracker(monkeypatch)
    config = LogConfig(flush=1000, segment_bytes=1024)
    log = PartitionLog(str(tmp_path / "t-0"), config, now_ms=0)
    seq = 0
    while len(log.segments) < 2:
        log.append(batch([b"x" * 200], producer_id=7, producer_epoch=0, base_sequence=seq, transactional=True), 0)
        seq += 1
    # The rolled segment's seal is still queued for the flusher; the marker must not depend on it.
    marker = log.append_marker(7, 0, commit=True, coordinator_epoch=0, now_ms=0)
    power_loss(log.directory, synced)
    reopened = PartitionLog(log.directory, config)
    assert reopened.log_end_offset == marker + 1
    assert not reopened.has_open_transaction(7)


def test_a_crash_while_sealing_under_fsync_always_keeps_no_torn_batch(tmp_path, monkeypatch):
    # A clean close gave the active segment an index file. Appended to again (group commit: unsynced),
    # it must be sealed before the next segment exists, or recovery would trust that stale index.
    config = LogConfig(segment_bytes=1024)
    log = PartitionLog(str(tmp_path / "t-0"), config, now_ms=0)
    log.append(batch([b"x" * 200]), 0)
    log.close()
    log = PartitionLog(log.directory, config, now_ms=0)
    log.append(batch([b"y" * 200]), 0, defer_fsync=True)
    log.append(batch([b"z" * 200]), 0, defer_fsync=True)
    first = log.segments[0]

    def power_lost(self):
        raise OSError(errno.EIO, "the power went during the fsync")

    monkeypatch.setattr(Segment, "seal", power_lost)
    with pytest.raises(KafkaStorageError):
        log.append(batch([b"w" * 800]), 0, defer_fsync=True)
    monkeypatch.undo()
    with open(first.path, "r+b") as f:  # a page of the unsynced last batch never made it
        f.seek(first.size - 5)
        byte = f.read(1)
        f.seek(first.size - 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    reopened = PartitionLog(log.directory, config)
    assert [v for _, _, _, v in decode(reopened.read(0, 1 << 20))] == [b"x" * 200, b"y" * 200]


def open_deleted_segments(directory) -> list[str]:
    """Descriptors this process holds on deleted segment files under ``directory``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)) and target.endswith(".log (deleted)"):
                found.append(target)
    return found


def test_deleting_a_log_with_queued_seals_releases_their_descriptors(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024), now_ms=0)
    while len(log.segments) < 4:
        log.append(batch([b"x" * 200]), 0)
    log.delete_files()
    assert open_deleted_segments(tmp_path) == []


def test_a_seal_handed_to_the_flusher_does_nothing_once_the_topic_is_deleted(tmp_path):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024), now_ms=0)
    while len(log.segments) < 2:
        log.append(batch([b"x" * 200]), 0)
    sync = log.flush_due(0)
    log.delete_files()
    os.makedirs(log.directory, exist_ok=True)  # the topic created again
    sync()
    assert os.listdir(log.directory) == []  # no index or snapshot of the old topic written into it
    assert open_deleted_segments(tmp_path) == []


def test_no_descriptor_for_the_active_segment_keeps_the_queued_seals(tmp_path, monkeypatch):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024), now_ms=0)
    while len(log.segments) < 2:
        log.append(batch([b"x" * 200]), 0)
    log.append(batch([b"y" * 10]), 0)

    def no_descriptors(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patch:
        patch.setattr(segment_module.os, "dup", no_descriptors)
        with pytest.raises(OSError):
            log.flush_due(0)  # LogManager postpones it
    log.flush_due(10_000)()
    assert os.path.exists(index_path(log.directory, 0))


def test_a_segment_recovery_had_to_check_gets_its_index_so_the_next_start_trusts_it(tmp_path, monkeypatch):
    config = LogConfig(flush=1000, segment_bytes=1024)
    log = PartitionLog(str(tmp_path / "t-0"), config, now_ms=0)
    while len(log.segments) < 3:
        log.append(batch([b"x" * 200]), 0)
    # A crash before the flusher sealed them: no index files for the rolled segments.
    assert not os.path.exists(index_path(log.directory, 0))
    PartitionLog(log.directory, config)  # recovery CRC-checks them, then writes their index
    assert os.path.exists(index_path(log.directory, 0))
    checked = []
    real_open = Segment.open.__func__
    monkeypatch.setattr(Segment, "open", classmethod(
        lambda cls, directory, base, interval, *, recover, **more: checked.append((base, recover))
        or real_open(cls, directory, base, interval, recover=recover, **more)))
    PartitionLog(log.directory, config)
    assert [recover for _, recover in checked] == [False] * (len(checked) - 1) + [True]


def test_retention_right_after_a_roll_does_not_fsync_what_it_deletes(tmp_path, monkeypatch):
    log = PartitionLog(str(tmp_path / "t-0"), LogConfig(flush=1000, segment_bytes=1024, retention_bytes=1),
                       now_ms=0)
    calls = []
    monkeypatch.setattr(segment_module, "_fdatasync", lambda fd: calls.append(fd))
    while log.log_start_offset == 0:  # each roll lets retention delete the segment it just rolled
        log.append(batch([b"x" * 200]), 0)
    assert calls == []
