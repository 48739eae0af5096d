"""The broker's topics: one PartitionLog per ``<data_dir>/<topic>-<partition>/`` plus ``topics.json``.

``topics.json`` (topic id, partition count and config overrides per topic) is the source of truth and is
replaced atomically; it is validated on load (a damaged one stops the start with a message naming it).
Partition directories holding records that it does not name (``topics.json`` lost) are recovered at
start as topics with default configs, with a WARNING naming them; the manager never removes a
directory holding records unless it marked it itself (``.deleting``, written by a delete before the
files go, so a delete cut by a crash is finished at the next start, not half undone). An flock on
the data directory itself (not on a file in it, which an operator could delete) keeps a second broker
off it.

Example::

    manager = LogManager("/var/lib/twophase", LogConfig(flush=1000))
    manager.create_topic("orders", partitions=3, config={"retention.ms": "3600000"})
    manager.partition("orders", 0).append(records, now_ms)
    manager.topics()["orders"].topic_id
    due = manager.flush_due(now_ms)                                # from a periodic task, then
    for plog, exc in run_flushes(due): plog.flush_failed(exc)      # run_flushes in a worker thread
    manager.enforce_retention(now_ms)
    manager.close()

All methods are synchronous and quick; the broker calls them from its single asyncio event-loop thread,
so there is no locking. The one exception is the slow part of creating a topic (its partition
directories, files and fsyncs): ``create_topic_files`` may run in a worker thread between
``begin_topic`` and ``finish_topic``, as it touches only the new topic's directories::

    info = manager.begin_topic("orders", 100)                              # checks, reserves the name
    opened = await asyncio.to_thread(manager.create_topic_files, "orders", info)
    manager.finish_topic("orders", info, opened)                           # topics.json, visible
    # (or manager.abandon_topic("orders", opened) if it is not to be)
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twophase.durable import atomic_write, fsync_dir
from twophase.wire.errors import (
    InvalidPartitionsError,
    InvalidTopicError,
    KafkaError,
    KafkaStorageError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)

from .config import LogConfig, normalize_overrides
from .errors import DataDirLockedError, MetadataFileError
from .log import PartitionLog
from .open_files import OpenFiles

log = logging.getLogger(__name__)

METADATA_FILE = "topics.json"
DELETING_MARKER = ".deleting"  # in a partition directory: its topic was deleted, its files are the broker's to remove
POLICY_VIOLATION = 44  # Kafka's error code for a create a broker policy refuses
MAX_TOPIC_NAME = 249
_LEGAL_TOPIC = re.compile(r"[a-zA-Z0-9._-]+")


@dataclass(frozen=True)
class TopicInfo:
    """What the broker knows of one topic: its id, partition count and config overrides.

    Usage::

        info = manager.create_topic("orders", partitions=3, config={"retention.ms": "3600000"})
        info.topic_id, info.partitions         # uuid.UUID(...), 3
        manager.topics()["orders"] == info     # True
    """
    topic_id: uuid.UUID
    partitions: int
    config: Mapping[str, Any] = field(default_factory=dict)  # overrides of the broker's LogConfig


def validate_topic_name(name: str) -> None:
    """Kafka's rules: 1-249 characters from [a-zA-Z0-9._-], and not '.' or '..'."""
    if not name or name in (".", ".."):
        raise InvalidTopicError(f"illegal topic name {name!r}")
    if len(name) > MAX_TOPIC_NAME:
        raise InvalidTopicError(f"topic name longer than {MAX_TOPIC_NAME} characters")
    if not _LEGAL_TOPIC.fullmatch(name):
        raise InvalidTopicError(f"topic name {name!r} has characters outside [a-zA-Z0-9._-]")


def _new_topic_id() -> uuid.UUID:
    while True:
        topic_id = uuid.uuid4()
        # Kafka never hands out an id whose base64 form starts with '-': command-line tools read it as a flag.
        if topic_id.bytes[0] >> 2 != 62:
            return topic_id


def _partition_dir_parts(name: str) -> tuple[str, int] | None:
    topic, sep, partition = name.rpartition("-")
    return (topic, int(partition)) if sep and topic and partition.isdigit() else None


def _holds_records(directory: str) -> bool:
    """Whether a partition directory has a non-empty segment (records nobody may silently remove)."""
    return any(entry.name.endswith(".log") and entry.stat().st_size > 0 for entry in os.scandir(directory))


def _being_deleted(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, DELETING_MARKER))


def _mark_for_deletion(directory: str) -> None:
    try:
        os.close(os.open(os.path.join(directory, DELETING_MARKER), os.O_WRONLY | os.O_CREAT, 0o644))
    except FileNotFoundError:
        return  # no directory: nothing to delete
    fsync_dir(directory)


def _unmark_for_deletion(directory: str) -> None:
    try:
        os.unlink(os.path.join(directory, DELETING_MARKER))
    except FileNotFoundError:
        return
    fsync_dir(directory)


def _lock_directory(data_dir: str) -> int:
    """An exclusive flock on ``data_dir`` itself, held by the returned descriptor.

    A lock on a file inside it would be lifted by deleting that file: a second broker would lock a new one.
    """
    fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirLockedError(f"{data_dir} is in use by another broker (it holds the directory's lock); "
                                 "stop that broker first") from None
    return fd


def _topic_info(path: str, name: Any, entry: Any) -> TopicInfo:
    """One topic of ``topics.json``, checked as strictly as CreateTopics checks a new one."""
    try:
        if not isinstance(name, str):
            raise InvalidTopicError(f"topic name {name!r} is not a string")
        validate_topic_name(name)
        if not isinstance(entry, dict):
            raise ValueError(f"expected an object, found {type(entry).__name__}")
        partitions = entry.get("partitions")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"partition count {partitions!r} is not an integer >= 1")
        config = entry.get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"config {config!r} is not an object")
        return TopicInfo(uuid.UUID(str(entry.get("topic_id"))), partitions, normalize_overrides(config))
    except (KafkaError, ValueError) as exc:
        raise MetadataFileError(f"{path}: topic {name!r}: {exc}; repair the entry or restore the file") from None


class LogManager:
    """All topic-partition logs under one data directory; ``max_partitions`` (None: no limit) is the
    most partitions all topics together may have: a create beyond it is refused (POLICY_VIOLATION)."""

    def __init__(self, data_dir: str, config: LogConfig | None = None, *, max_partitions: int | None = None) -> None:
        self.data_dir = data_dir
        self.config = config or LogConfig()
        self.max_partitions = max_partitions
        self._creating: dict[str, TopicInfo] = {}  # topics between begin_topic and finish/abandon_topic
        self._open_files = OpenFiles(OpenFiles.default_capacity())  # segment files: not one per partition
        os.makedirs(data_dir, exist_ok=True)
        self._lock_fd = _lock_directory(data_dir)
        self._logs: dict[tuple[str, int], PartitionLog] = {}
        try:
            self._topics: dict[str, TopicInfo] = self._load_metadata()
            self._unmark_listed_topics()
            self._finish_deletes()
            self._recover_unlisted_topics()
            self._warn_orphans()
            for name, info in self._topics.items():
                for p in range(info.partitions):
                    self._logs[(name, p)] = self._open(name, p, info)
            if max_partitions is not None and len(self._logs) > max_partitions:
                log.warning("%s: %d partitions exceed max_partitions %d: served, but no topic can be created",
                            data_dir, len(self._logs), max_partitions)
        except BaseException:
            self.close()  # the logs opened so far, and the lock: a failed start must not keep the directory
            raise

    # -- metadata ----------------------------------------------------------------------------------

    def _metadata_path(self) -> str:
        return os.path.join(self.data_dir, METADATA_FILE)

    def _load_metadata(self) -> dict[str, TopicInfo]:
        """The topics ``topics.json`` names (none without the file); MetadataFileError if it is damaged."""
        path = self._metadata_path()
        try:
            with open(path, "rb") as f:
                raw = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise MetadataFileError(
                f"{path} is unreadable ({exc}); restore it, or move it away: the broker then recovers the "
                "topics from their directories with default configs") from exc
        topics = raw.get("topics") if isinstance(raw, dict) else None
        if not isinstance(topics, dict):
            found = "an object without one" if isinstance(raw, dict) else f"a JSON {type(raw).__name__}"
            raise MetadataFileError(
                f"{path} holds {found} where a \"topics\" object belongs; restore it, or move it away: the "
                "broker then recovers the topics from their directories with default configs")
        return {name: _topic_info(path, name, entry) for name, entry in topics.items()}

    def _save_metadata(self, topics: dict[str, TopicInfo]) -> None:
        body = {
            "version": 1,
            "topics": {
                name: {"topic_id": str(t.topic_id), "partitions": t.partitions, "config": dict(t.config)}
                for name, t in sorted(topics.items())
            },
        }
        atomic_write(self._metadata_path(), json.dumps(body, indent=1).encode())

    def _partition_dirs(self) -> list[tuple[str, str, int]]:
        out = []
        for entry in os.listdir(self.data_dir):
            parts = _partition_dir_parts(entry)
            if parts and os.path.isdir(os.path.join(self.data_dir, entry)):
                out.append((entry, *parts))
        return out

    def _unlisted_dirs(self) -> list[tuple[str, str, int]]:
        """Partition directories that are not a partition of a topic in ``topics.json``."""
        return [(entry, topic, p) for entry, topic, p in self._partition_dirs()
                if topic not in self._topics or p >= self._topics[topic].partitions]

    def _unmark_listed_topics(self) -> None:
        """Remove the delete marks a crash left in directories of a topic ``topics.json`` still names (the
        delete never reached its commit point, see ``delete_topic``): the topic stays."""
        for entry, topic, p in self._partition_dirs():
            directory = os.path.join(self.data_dir, entry)
            info = self._topics.get(topic)
            if info is not None and p < info.partitions and _being_deleted(directory):
                log.warning("%s: a delete of topic %r was cut short before %s dropped it: the topic is kept",
                            directory, topic, METADATA_FILE)
                _unmark_for_deletion(directory)

    def _finish_deletes(self) -> None:
        """Remove what a delete cut short by a crash left: every unlisted directory of a topic with a marked one.

        Topic-wide, as the crash may have come before every partition was marked.
        """
        unlisted = self._unlisted_dirs()
        deleted = {topic for entry, topic, _ in unlisted if _being_deleted(os.path.join(self.data_dir, entry))}
        for entry, topic, _ in unlisted:
            if topic in deleted:
                log.warning("%s: finishing the delete of topic %r a crash cut short: removing %s", self.data_dir,
                            topic, entry)
                shutil.rmtree(os.path.join(self.data_dir, entry))

    def _recover_unlisted_topics(self) -> None:
        """Adopt partition directories holding records of topics ``topics.json`` does not name.

        Partitions 0..n-1 found make a topic of n partitions with default configs and a new topic id
        (what ``topics.json`` held of it is gone). A topic none of whose directories holds records has
        nothing to lose and is not recovered; a name CreateTopics would refuse, or a topic without
        partition 0, stays an orphan directory (``_warn_orphans``); creating it over records is refused.
        """
        found: dict[str, set[int]] = {}
        with_records: set[str] = set()
        for entry, topic, p in self._unlisted_dirs():
            if topic not in self._topics:
                found.setdefault(topic, set()).add(p)
                if _holds_records(os.path.join(self.data_dir, entry)):
                    with_records.add(topic)
        recovered = []
        for topic, numbers in sorted(found.items()):
            if topic not in with_records:
                continue
            count = next(p for p in range(len(numbers) + 1) if p not in numbers)
            try:
                self._check_name_and_partitions(topic, count)
            except KafkaError as exc:
                log.warning("%s: cannot recover topic %r from its directories: %s", self.data_dir, topic, exc)
                continue
            self._topics[topic] = TopicInfo(_new_topic_id(), count, {})
            recovered.append(f"{topic!r} ({count} partitions)")
        if recovered:
            log.warning("%s: %s does not name the topics of directories found here (lost, or a crash during a "
                        "create or delete); recovered %s with default configs and new topic ids: reapply any "
                        "config overrides", self.data_dir, METADATA_FILE, ", ".join(recovered))
            self._save_metadata(self._topics)

    def _warn_orphans(self) -> None:
        for entry, topic, p in self._partition_dirs():
            info = self._topics.get(topic)
            if info is None or p >= info.partitions:
                log.warning("%s: directory %r belongs to no known topic; left untouched", self.data_dir, entry)

    # -- topics ------------------------------------------------------------------------------------

    def topics(self) -> dict[str, TopicInfo]:
        """A copy of the topics, by name."""
        return dict(self._topics)

    def has_topic(self, name: str) -> bool:
        """Whether ``name`` is a topic (without copying them all: Produce asks per topic, per request)."""
        return name in self._topics

    def topic_config(self, name: str) -> LogConfig:
        """The broker's LogConfig with the topic's overrides; raises UnknownTopicOrPartitionError."""
        info = self._topics.get(name)
        if info is None:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        return self.config.with_overrides(info.config)

    def check_new_topic(self, name: str, partitions: int, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Raise the KafkaError creating this topic would raise, else return its normalized config overrides.

        CreateTopics with validate_only answers with this, so it agrees with a real create.
        """
        self._check_name_and_partitions(name, partitions)
        for entry, topic, _ in self._partition_dirs():
            directory = os.path.join(self.data_dir, entry)
            if topic == name and _holds_records(directory) and not _being_deleted(directory):
                raise TopicAlreadyExistsError(
                    f"directory {entry!r} holds records of a topic {name!r} this broker does not know; it is "
                    "never overwritten: move it away to create the topic, or restart the broker to recover it")
        return normalize_overrides(config or {})

    def _check_name_and_partitions(self, name: str, partitions: int) -> None:
        validate_topic_name(name)
        if name in self._topics:
            raise TopicAlreadyExistsError(f"topic {name!r} already exists")
        if name in self._creating:
            raise TopicAlreadyExistsError(f"topic {name!r} is being created")
        # Kafka rejects names that differ only by '.' vs '_': they collide in metric names.
        collision_key = name.replace(".", "_")
        for existing in (*self._topics, *self._creating):
            if existing.replace(".", "_") == collision_key:
                raise InvalidTopicError(f"topic {name!r} collides with existing topic {existing!r}")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise InvalidPartitionsError(f"partition count must be >= 1, got {partitions!r}")
        if self.max_partitions is not None:
            held = len(self._logs) + sum(info.partitions for info in self._creating.values())
            if held + partitions > self.max_partitions:
                raise KafkaError(f"topic {name!r} with {partitions} partitions would make {held + partitions} "
                                 f"partitions on this broker, over its limit of {self.max_partitions} "
                                 f"(max_partitions)", POLICY_VIOLATION)

    def create_topic(self, name: str, partitions: int, config: Mapping[str, Any] | None = None) -> TopicInfo:
        """Create a topic; ``config`` overrides use Kafka names (``retention.ms``) or LogConfig field names.

        All or nothing: every partition log is opened before ``topics.json`` names the topic; if the disk
        or the descriptor limit refuses one, what was created is removed and KafkaStorageError raised.
        The same in steps, the slow one in another thread: see the module docstring.
        """
        info = self.begin_topic(name, partitions, config)
        try:
            opened = self.create_topic_files(name, info)
        except BaseException:
            self.abandon_topic(name, [])
            raise
        return self.finish_topic(name, info, opened)

    def begin_topic(self, name: str, partitions: int, config: Mapping[str, Any] | None = None) -> TopicInfo:
        """Check a create (the KafkaError it meets) and reserve the name and partitions until
        ``finish_topic`` or ``abandon_topic``; returns the new topic's info."""
        info = TopicInfo(_new_topic_id(), partitions, self.check_new_topic(name, partitions, config))
        self._creating[name] = info
        return info

    def being_created(self, name: str) -> bool:
        """Whether ``name`` is between ``begin_topic`` and ``finish_topic``/``abandon_topic``."""
        return name in self._creating

    def create_topic_files(self, name: str, info: TopicInfo) -> list[PartitionLog]:
        """Create and fsync the partition logs of a topic from ``begin_topic``; may run in any thread,
        as it touches only that topic's directories. On failure what it made is removed and
        KafkaStorageError raised."""
        opened: list[PartitionLog] = []
        try:
            # Empty or marked leftovers (check_new_topic refused any others) must not resurface as its data.
            for entry, topic, _ in self._partition_dirs():
                if topic == name:
                    shutil.rmtree(os.path.join(self.data_dir, entry))
            for p in range(info.partitions):
                opened.append(self._open(name, p, info))
                opened[-1].release_files()  # opened in this thread: the event loop's OpenFiles does not count them
            fsync_dir(self.data_dir)
        except OSError as exc:
            self._discard_new_topic(name, info.partitions, opened)
            raise KafkaStorageError(f"creating topic {name!r} failed: {exc}") from exc
        return opened

    def finish_topic(self, name: str, info: TopicInfo, opened: list[PartitionLog]) -> TopicInfo:
        """Name the topic in ``topics.json`` and serve its logs (``opened``, from ``create_topic_files``)."""
        try:
            self._save_metadata({**self._topics, name: info})
        except OSError as exc:
            self.abandon_topic(name, opened)
            raise KafkaStorageError(f"creating topic {name!r} failed: {exc}") from exc
        del self._creating[name]
        self._topics[name] = info
        self._logs.update(((name, p), plog) for p, plog in enumerate(opened))
        log.info("created topic %r (%d partitions, id %s)", name, info.partitions, info.topic_id)
        return info

    def abandon_topic(self, name: str, opened: list[PartitionLog]) -> None:
        """Give up a create from ``begin_topic``: remove what ``create_topic_files`` made (``opened``)."""
        info = self._creating.pop(name)
        if opened:
            self._discard_new_topic(name, info.partitions, opened)

    def _discard_new_topic(self, name: str, partitions: int, opened: list[PartitionLog]) -> None:
        """Undo a failed create_topic, as far as the disk lets us; what stays behind is an orphan directory."""
        for plog in opened:
            try:
                plog.delete_files()  # closes its files first: descriptors for what follows
            except OSError as exc:
                log.warning("removing %s after a failed create: %s", plog.directory, exc)
        for p in range(partitions):
            shutil.rmtree(self._dir(name, p), ignore_errors=True)
        try:
            if name in self._load_metadata():  # the failure came after topics.json was replaced (its dir fsync)
                self._save_metadata(self._topics)
        except OSError as exc:
            log.warning("%s: restoring %s after a failed create: %s", self.data_dir, METADATA_FILE, exc)

    def delete_topic(self, name: str) -> None:
        """Mark the topic's directories, drop it from ``topics.json``, then remove its files; raises
        UnknownTopicOrPartitionError.

        Saving ``topics.json`` is the delete's commit point. A crash before it leaves a listed topic with
        marked directories: the next start keeps it and removes the marks (``_unmark_listed_topics``). A
        crash after it leaves marked directories no topic names: the next start finishes the delete
        (``_finish_deletes``) instead of recovering the topic.
        """
        info = self._topics.get(name)
        if info is None:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        remaining = {k: v for k, v in self._topics.items() if k != name}
        directories = [self._dir(name, p) for p in range(info.partitions)]
        try:
            for directory in directories:
                _mark_for_deletion(directory)
            self._save_metadata(remaining)
        except Exception:
            if name in self._load_metadata():  # not dropped: the topic stays, and must not be deleted at start
                for directory in directories:
                    _unmark_for_deletion(directory)
                raise
            # The new topics.json is in place (its directory fsync failed): the delete went through.
            log.warning("%s: the fsync of %s failed after it dropped topic %r: deleting it", self.data_dir,
                        METADATA_FILE, name, exc_info=True)
        self._topics = remaining
        for p in range(info.partitions):
            partition_log = self._logs.pop((name, p), None)
            if partition_log is not None:
                partition_log.delete_files()
            shutil.rmtree(self._dir(name, p), ignore_errors=True)
        fsync_dir(self.data_dir)
        log.info("deleted topic %r", name)

    # -- partitions --------------------------------------------------------------------------------

    def _dir(self, topic: str, partition: int) -> str:
        return os.path.join(self.data_dir, f"{topic}-{partition}")

    def _open(self, topic: str, partition: int, info: TopicInfo) -> PartitionLog:
        return PartitionLog(self._dir(topic, partition), self.config.with_overrides(info.config),
                            open_files=self._open_files)

    def partition(self, topic: str, partition: int) -> PartitionLog:
        """The PartitionLog of the partition; raises UnknownTopicOrPartitionError.

        A log a failed write or fsync took offline is opened again once its back-off has passed (space may
        be back), and replaces it from then on.
        """
        partition_log = self._logs.get((topic, partition))
        if partition_log is None:
            raise UnknownTopicOrPartitionError(f"unknown topic-partition {topic}-{partition}")
        if partition_log.offline and (reopened := partition_log.reopen()) is not None:
            self._logs[(topic, partition)] = partition_log = reopened
        return partition_log

    def partitions(self) -> dict[tuple[str, int], PartitionLog]:
        """A copy of every PartitionLog, by (topic, partition)."""
        return dict(self._logs)

    # -- periodic work and shutdown ----------------------------------------------------------------

    def flush_due(self, now_ms: int) -> list[tuple[PartitionLog, Callable[[], None]]]:
        """Every log whose flush interval has elapsed, with its detached fsync: pass them to ``run_flushes``."""
        due = []
        for key, plog in self._logs.items():
            try:
                sync = plog.flush_due(now_ms)
            except OSError as exc:  # no descriptor to spare: the log stays unsynced, tried again next time
                log.warning("flush of %s-%d postponed: %s", *key, exc)
                continue
            if sync is not None:
                due.append((plog, sync))
        return due

    def shortest_flush_interval_ms(self) -> int | None:
        """The shortest fsync interval of any log (topic ``flush.ms`` overrides included); None if all are "always"."""
        return min((i for plog in self._logs.values() if (i := plog.config.flush_interval_ms)), default=None)

    def enforce_retention(self, now_ms: int) -> int:
        """Apply retention to every log; returns the number of segments deleted."""
        deleted = 0
        for key, partition_log in self._logs.items():
            try:
                deleted += partition_log.enforce_retention(now_ms)
            except KafkaStorageError as exc:  # an offline log must not stop retention elsewhere
                log.warning("retention skipped for %s-%d: %s", *key, exc)
        return deleted

    def close(self) -> None:
        """Close every log cleanly and release the data directory. Idempotent."""
        try:
            for key, partition_log in self._logs.items():
                try:
                    partition_log.close()  # releases its descriptors even when it fails
                except Exception:
                    log.exception("closing %s-%d failed", *key)
            self._logs.clear()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def run_flushes(due: list[tuple[PartitionLog, Callable[[], None]]]) -> list[tuple[PartitionLog, Exception]]:
    """Run the fsyncs from ``LogManager.flush_due`` (in a worker thread); returns the logs whose fsync failed.

    Storage is not thread-safe, so the caller takes those logs offline (``flush_failed``) on the event loop.
    """
    failed = []
    for plog, sync in due:
        try:
            sync()
        except Exception as exc:  # whatever failed, the data may not be on disk
            failed.append((plog, exc))
    return failed
