"""Driver side of the ``twophase-kafka`` source: which partitions it reads, and the offset ranges of a batch.

Offsets are Spark Kafka's JSON, ``{topic: {"partition": next offset}}`` (partition numbers as strings,
as JSON keys must be): they live in the query's checkpoint, so a restarted query plans a batch over
exactly the offsets it planned before. Every partition the source reads is in every offset dict: a
partition seen for the first time (added to a topic, or a new topic matching ``subscribePattern``)
enters at its earliest offset with an empty range, and is read from there by the next batches, so
even the first range of a new partition comes from the checkpoint.

Under ``read_committed`` the latest offset is the partition's last stable offset (ListOffsets with
isolation level 1): a batch never ends past an open transaction. Offsets that retention deleted, a
partition gone, or offsets going backwards (the topic deleted and created again) are data loss:
:class:`DataLoss` under ``failOnDataLoss=true``, else skipped and logged as a WARNING naming what.

Example::

    with OffsetPlanner(options) as planner:
        partitions = planner.current_partitions()
        start = planner.resolve(options.starting, "startingOffsets", partitions)
        end = planner.latest_offsets(start, max_rows=10_000)
    ranges = plan(options, start, end)        # twophase.spark.source.plan: one KafkaRange per partition to read
"""

from __future__ import annotations

import logging

from twophase.client import EARLIEST, LATEST, Admin
from twophase.client.errors import check
from twophase.client.retry import retry

from .source_options import SourceOptionError, SourceOptions

log = logging.getLogger("twophase.spark.source")

TopicPartition = tuple[str, int]
Offsets = dict[TopicPartition, int]


class DataLoss(RuntimeError):
    """Records the query should read are gone (retention, a deleted or recreated topic) and
    ``failOnDataLoss`` is true; the message names the topic, partition and offsets."""


def to_json(offsets: Offsets) -> dict[str, dict[str, int]]:
    """Spark Kafka's offset JSON: {topic: {"partition": offset}}."""
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[str(partition)] = offset
    return out


def from_json(value: dict) -> Offsets:
    """The inverse of :func:`to_json`."""
    return {(topic, int(p)): int(o) for topic, partitions in value.items() for p, o in partitions.items()}


def report_loss(fail: bool, what: str) -> None:
    """DataLoss under failOnDataLoss=true, else a WARNING (the records are skipped)."""
    if fail:
        raise DataLoss(f"{what}. Some data may have been lost; set failOnDataLoss=false to skip it "
                       "(logged as a WARNING) instead of failing the query")
    log.warning("%s: skipped (failOnDataLoss=false)", what)


def limit_rows(start: Offsets, end: Offsets, max_rows: int) -> Offsets:
    """``end`` moved back so that at most ``max_rows`` offsets lie in all ranges together, shared in
    proportion to each partition's range (as Spark's Kafka source shares maxOffsetsPerTrigger)."""
    sizes = {tp: end[tp] - start[tp] for tp in end if tp in start and end[tp] > start[tp]}
    total = sum(sizes.values())
    if total <= max_rows:
        return dict(end)
    shares = {tp: size * max_rows // total for tp, size in sizes.items()}
    left = max_rows - sum(shares.values())
    for tp in sorted(sizes, key=lambda tp: sizes[tp] - shares[tp], reverse=True):  # the rounding, one each
        if left == 0:
            break
        if shares[tp] < sizes[tp]:
            shares[tp] += 1
            left -= 1
    return {tp: start[tp] + shares[tp] if tp in sizes else o for tp, o in end.items()}


class OffsetPlanner:
    """One driver-side admin client for a source: partitions, earliest and latest offsets, batch plans.

    Kept open across micro-batches by the stream reader and closed by its ``stop()``; the batch reader
    opens one per plan.

    Usage::

        with OffsetPlanner(options) as planner:
            planner.current_partitions()        # [("orders", 0), ...]
    """

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.available: Offsets | None = None  # every readable offset the last latest_offsets saw (for lag)
        self.admin = Admin(options.bootstrap, request_timeout_ms=options.request_timeout_ms,
                           client_id=options.client_id, security=options.security)

    def current_partitions(self) -> list[TopicPartition]:
        """The partitions the source reads now, from fresh metadata (topics that do not exist: none).

        A broker that cannot be reached (restarting) is retried for up to kafka.request.timeout.ms."""
        cluster = self.admin.cluster
        opts = self.options
        if opts.subscribe_pattern is not None:
            codes = retry(lambda: cluster.refresh(None), self.admin.request_timeout_s, "Metadata")
            topics = [t for t, code in codes.items()
                      if code == 0 and not t.startswith("__") and opts.matches(t)]  # "__": internal topics
        else:
            wanted = sorted(set(opts.subscribe) | {t for t, _ in opts.assign})
            codes = retry(lambda: cluster.refresh(wanted), self.admin.request_timeout_s, "Metadata")
            topics = [t for t in wanted if codes.get(t) == 0]
            for t in wanted:
                if codes.get(t) not in (0, 3):  # 3: UNKNOWN_TOPIC_OR_PARTITION: not created (yet)
                    check(codes[t], f"metadata for topic {t!r}")
        found = [(t, p) for t in topics for p in cluster.partitions(t)]
        if opts.assign:
            found = [tp for tp in opts.assign if tp in set(found)]
        return sorted(found)

    def earliest(self, partitions: list[TopicPartition]) -> Offsets:
        """Each partition's log start offset."""
        return self.admin.list_offsets(partitions, EARLIEST) if partitions else {}

    def latest(self, partitions: list[TopicPartition]) -> Offsets:
        """Each partition's readable end: the last stable offset under read_committed, else the high watermark."""
        return self.admin.list_offsets(partitions, LATEST, self.options.isolation_level) if partitions else {}

    def resolve(self, spec: str | dict[str, dict[int, int]], name: str, partitions: list[TopicPartition]) -> Offsets:
        """``startingOffsets`` / ``endingOffsets`` (earliest, latest or JSON with -2/-1) as offsets of ``partitions``.

        A JSON value must name exactly the partitions the source reads (as Spark's Kafka source asks),
        else SourceOptionError naming ``name``."""
        if spec == "earliest":
            return self.earliest(partitions)
        if spec == "latest":
            return self.latest(partitions)
        given = {(t, p): o for t, ps in spec.items() for p, o in ps.items()}
        if set(given) != set(partitions):
            missing = sorted(set(partitions) - set(given))
            extra = sorted(set(given) - set(partitions))
            raise SourceOptionError(
                f"option {name!r} must give an offset for every partition the source reads and no other "
                f"(use -2 for earliest, -1 for latest): missing {missing}, not read {extra}")
        earliest = self.earliest([tp for tp, o in given.items() if o == EARLIEST])
        latest = self.latest([tp for tp, o in given.items() if o == LATEST])
        return {tp: earliest.get(tp, latest.get(tp, o)) if o < 0 else o for tp, o in given.items()}

    def latest_offsets(self, start: Offsets, max_rows: int | None = None, target: Offsets | None = None) -> Offsets:
        """The end of the next batch from ``start``: every readable offset, at most ``max_rows`` offsets
        in all (maxOffsetsPerTrigger), none past ``target`` (Trigger.AvailableNow's end).

        New partitions enter at their earliest offset; data loss is reported (:func:`report_loss`) and,
        if skipped, a partition gone leaves the offsets and one whose offsets went backwards restarts at
        its new earliest offset."""
        current = self.current_partitions()
        fail = self.options.fail_on_data_loss
        for tp in sorted(set(start) - set(current)):
            report_loss(fail, f"{tp[0]}-{tp[1]} is gone (topic deleted, or no longer read) at offset {start[tp]}")
        # Trigger.AvailableNow: only the partitions there were when it started; the others stay where they are.
        partitions = current if target is None else [tp for tp in current if tp in target]
        earliest, latest = self.earliest(partitions), self.latest(partitions)
        end: Offsets = {}
        for tp in partitions:
            if tp not in start:
                end[tp] = earliest[tp]
                continue
            begin, until = start[tp], latest[tp]
            if target is not None:
                until = min(until, target[tp])
            if begin > latest[tp]:
                report_loss(fail, f"{tp[0]}-{tp[1]}: offsets went backwards from {begin} to {latest[tp]} "
                                  "(topic deleted and created again?); restarting at its earliest offset "
                                  f"{earliest[tp]}")
                end[tp] = earliest[tp]  # an empty (backwards) range: the next batch reads from there
                continue
            if begin < earliest[tp]:
                report_loss(fail, f"{tp[0]}-{tp[1]}: offsets {begin} to {earliest[tp]} were deleted (retention?)")
            end[tp] = max(begin, until)
        for tp in set(current) - set(partitions):
            if tp in start:
                end[tp] = start[tp]
        self.available = {**end, **{tp: max(end[tp], latest[tp]) for tp in partitions}}
        if max_rows is not None:
            end = limit_rows(start, end, max_rows)
        return end

    def close(self) -> None:
        """Close the admin client's connections."""
        self.admin.close()

    def __enter__(self) -> OffsetPlanner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
