"""kcat (Debian's package, linked against the system librdkafka 2.0.2) against the broker."""

from __future__ import annotations

import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed")


def kcat(*args: str, input: str | None = None) -> str:
    result = subprocess.run(["kcat", *args], input=input, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("compression", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_produce_and_consume(broker_factory, topic, compression):
    b = broker_factory(default_partitions=2)
    lines = [f"key{i % 3}:value {i}" for i in range(50)]
    kcat("-b", b.bootstrap, "-P", "-t", topic, "-K:", "-z", compression, "-H", "origin=kcat",
         input="\n".join(lines) + "\n")
    out = kcat("-b", b.bootstrap, "-C", "-t", topic, "-e", "-q", "-f", "%p %o %k %s %h\n")
    rows = [line.split(" ", 3) for line in out.splitlines()]
    assert len(rows) == 50
    by_partition: dict[str, list] = {}
    for p, offset, key, rest in rows:
        value, headers = rest.rsplit(" ", 1)
        assert headers == "origin=kcat"
        by_partition.setdefault(p, []).append((int(offset), key, value))
    received = []
    for entries in by_partition.values():
        assert [o for o, _, _ in entries] == list(range(len(entries)))
        numbers = [int(v.split()[1]) for _, _, v in entries]
        assert numbers == sorted(numbers)  # in order within a partition
        for _, key, value in entries:
            assert key == f"key{int(value.split()[1]) % 3}"
        received += numbers
    assert sorted(received) == list(range(50))


def test_metadata_listing(broker, topic):
    kcat("-b", broker.bootstrap, "-P", "-t", topic, input="x\n")
    out = kcat("-b", broker.bootstrap, "-L")
    assert f"broker 0 at {broker.bootstrap} (controller)" in out
    assert f'topic "{topic}" with 1 partitions' in out


def test_consume_from_offset_and_tail(broker, topic):
    kcat("-b", broker.bootstrap, "-P", "-t", topic, "-p", "0", input="".join(f"m{i}\n" for i in range(10)))
    out = kcat("-b", broker.bootstrap, "-C", "-t", topic, "-p", "0", "-o", "7", "-e", "-q", "-f", "%o:%s\n")
    assert out.splitlines() == ["7:m7", "8:m8", "9:m9"]
    out = kcat("-b", broker.bootstrap, "-C", "-t", topic, "-p", "0", "-o", "-2", "-e", "-q", "-f", "%s\n")
    assert out.splitlines() == ["m8", "m9"]
