"""Property test: any sequence of appends reads back exactly, from any offset, before and after reopen."""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twophase.broker.storage import LogConfig, PartitionLog
from twophase.wire.errors import CorruptRecordError

from .batches import batch, batch_offsets, decode
from .conftest import logs_in

record = st.tuples(st.one_of(st.none(), st.binary(max_size=8)), st.binary(max_size=120))
a_batch = st.tuples(st.lists(record, min_size=1, max_size=6), st.integers(min_value=0, max_value=10**6))
appends = st.lists(st.lists(a_batch, min_size=1, max_size=3), min_size=1, max_size=25)


def check_log(log: PartitionLog, expected: list[tuple[bytes | None, bytes]], max_bytes: int) -> None:
    assert log.high_watermark == len(expected)
    # Consumer-style walk with a small budget: every record once, in order.
    seen, offset = [], 0
    while offset < log.high_watermark:
        data = log.read(offset, max_bytes)
        records = [r for r in decode(data) if r[0] >= offset]
        assert records and records[0][0] == offset
        seen.extend((k, v) for _, _, k, v in records)
        offset = batch_offsets(data)[-1][1] + 1
    assert seen == expected
    for start in range(0, len(expected), 7):
        (base, last), *_ = batch_offsets(log.read(start, 1))
        assert base <= start <= last


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(appends, st.integers(min_value=1024, max_value=3000), st.integers(min_value=0, max_value=600),
       st.integers(min_value=1, max_value=2000))
def test_random_appends_read_back(requests, segment_bytes, index_interval, max_bytes):
    config = LogConfig(segment_bytes=segment_bytes, index_interval_bytes=index_interval)
    with tempfile.TemporaryDirectory() as tmp, logs_in(tmp) as open_log:
        log = open_log(config)
        expected: list[tuple[bytes | None, bytes]] = []
        for request in requests:
            data = b"".join(
                batch([v for _, v in recs], keys=[k for k, _ in recs], timestamp=ts) for recs, ts in request)
            result = log.append(data, 0)
            count = sum(len(recs) for recs, _ in request)
            assert (result.base_offset, result.last_offset) == (len(expected), len(expected) + count - 1)
            expected.extend(r for recs, _ in request for r in recs)
        check_log(log, expected, max_bytes)
        log.close()
        check_log(open_log(config), expected, max_bytes)
        # And after a "crash": the index of the active segment is rebuilt from the log.
        crashed = open_log(config)
        crashed.append(batch([b"tail"]), 0)
        check_log(open_log(config), expected + [(None, b"tail")], max_bytes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=15), st.data())
def test_damaged_tail_recovers_intact_prefix(batch_sizes, data):
    """Cut or flip a byte anywhere in the active segment: every batch before the damage survives; a flipped
    byte with batches after it is not a torn tail: they are kept (not served), and their offsets stay taken."""
    with tempfile.TemporaryDirectory() as tmp, logs_in(tmp) as open_log:
        log = open_log()
        expected, ends = [], []
        for i, n in enumerate(batch_sizes):
            vals = [b"b%d-%d" % (i, j) for j in range(n)]
            log.append(batch(vals), 0)
            expected.append(vals)
            ends.append(log.segments[-1].size)
        path = log.segments[-1].path
        where = data.draw(st.integers(min_value=0, max_value=ends[-1] - 1))
        starts = [0] + ends[:-1]
        cut = data.draw(st.booleans())
        with open(path, "r+b") as f:
            if cut:
                f.truncate(where)
            elif any(s + 12 <= where < s + 16 for s in starts):
                return  # partitionLeaderEpoch is outside the CRC by design: such damage is undetectable
            else:
                f.seek(where)
                byte = f.read(1)[0]
                f.seek(where)
                f.write(bytes([byte ^ data.draw(st.integers(min_value=1, max_value=255))]))
        intact = sum(1 for end in ends if end <= where)  # batches entirely before the damage
        reopened = open_log()
        try:
            survivors = [v for _, _, _, v in decode(reopened.read(0, 1 << 20))] if reopened.high_watermark else []
        except CorruptRecordError:  # the first batch is the damaged one
            survivors = []
        assert survivors == [v for vals in expected[:intact] for v in vals]
        if not cut and intact < len(expected) - 1:
            assert reopened.log_end_offset == sum(batch_sizes)
