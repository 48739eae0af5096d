"""Kafka's default partitioner: murmur2 of the key, so keys land where Java clients and
librdkafka's ``murmur2_random`` put them; keyless records stick to one partition per batch.

Example::

    partition_for_key(b"user-42", 6)      # same as Java's Utils.toPositive(Utils.murmur2(key)) % 6
"""

from __future__ import annotations

import random

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


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


def partition_for_key(key: bytes, num_partitions: int) -> int:
    """The partition of a keyed record, as Kafka's default partitioner computes it (murmur2)."""
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions


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
