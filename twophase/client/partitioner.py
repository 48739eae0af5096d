"""Kafka's default partitioner: murmur2 of the key, so keys land where Java clients and
librdkafka's ``murmur2_random`` put them; keyless records stick to one partition per batch.

Example::

    partition_for_key(b"user-42", 6)      # same as Java's Utils.toPositive(Utils.murmur2(key)) % 6
    [key_partition(h, 6) for h in murmur2_many([b"user-42", b"user-43"])]   # the same, for many keys at once
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
VECTOR_KEY_BYTES = 64  # murmur2_many hashes longer keys one at a time


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (seed 0x9747b28c) as an unsigned 32-bit integer."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    tail = length & ~3
    for i in range(0, tail, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[tail + 2] << 16
    if rest >= 2:
        h ^= data[tail + 1] << 8
    if rest >= 1:
        h ^= data[tail]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def murmur2_many(keys: Sequence[bytes]) -> list[int]:
    """:func:`murmur2` of each key: keys up to :data:`VECTOR_KEY_BYTES` a 4-byte block at a time across
    all of them (numpy; a bulk writer's keys cost a fraction of a microsecond each instead of one or
    more), longer ones one by one (a block step per 4 bytes of the longest key would cost more)."""
    long_keys = {i: murmur2(key) for i, key in enumerate(keys) if len(key) > VECTOR_KEY_BYTES}
    if not long_keys:
        return _murmur2_vector(keys)
    hashes = _murmur2_vector([b"" if i in long_keys else key for i, key in enumerate(keys)])
    for i, h in long_keys.items():
        hashes[i] = h
    return hashes


def _murmur2_vector(keys: Sequence[bytes]) -> list[int]:
    if not keys:
        return []
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    data = np.frombuffer(b"".join(keys) + b"\0\0\0", dtype=np.uint8).astype(np.uint32)  # padded: tails read ahead
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    blocks = lengths >> 2
    m = np.uint32(_M)
    h = np.uint32(0x9747B28C) ^ lengths.astype(np.uint32)
    with np.errstate(over="ignore"):  # uint32 products wrap, as the reference's masks make them
        for j in range(int(blocks.max())):
            rows = np.nonzero(blocks > j)[0]
            at = starts[rows] + 4 * j
            k = data[at] | data[at + 1] << 8 | data[at + 2] << 16 | data[at + 3] << 24
            k *= m
            k ^= k >> 24
            k *= m
            h[rows] = (h[rows] * m) ^ k
        tail, rest = starts + (blocks << 2), lengths & 3
        h ^= np.where(rest == 3, data[tail + 2] << 16, 0).astype(np.uint32)
        h ^= np.where(rest >= 2, data[tail + 1] << 8, 0).astype(np.uint32)
        h = np.where(rest >= 1, (h ^ data[tail]) * m, h).astype(np.uint32)
        h ^= h >> 13
        h *= m
        h ^= h >> 15
    return h.tolist()


def key_partition(hash32: int, num_partitions: int) -> int:
    """The partition of a key whose :func:`murmur2` is ``hash32`` (Java's ``toPositive(hash) % n``)."""
    return (hash32 & 0x7FFFFFFF) % num_partitions


def partition_for_key(key: bytes, num_partitions: int) -> int:
    """The partition of a keyed record, as Kafka's default partitioner computes it (murmur2)."""
    return key_partition(murmur2(key), num_partitions)


class StickyPartitions:
    """Keyless records of a topic go to one random partition until its batch is sent (Kafka's sticky
    partitioner): bigger batches than round-robin."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}

    def partition(self, topic: str, num_partitions: int) -> int:
        """The topic's current sticky partition, chosen at random when there is none (or it is out of range)."""
        current = self._current.get(topic)
        if current is None or current >= num_partitions:
            current = self._current[topic] = random.randrange(num_partitions)
        return current

    def batch_sent(self, topic: str, partition: int) -> None:
        """A batch for ``partition`` was sent: the topic's next keyless record picks a new partition."""
        if self._current.get(topic) == partition:
            del self._current[topic]
