"""Slots: small numbers that task attempts of one (query, partition) hold in turn.

A task claims the lowest free slot of its partition in the same multi-op that records its intent
(:meth:`PrecommitRegistry.intend <coordinator.precommits.PrecommitRegistry.intend>`), so at any
moment the unsettled attempts of a partition hold distinct slots. ``slots/<p>/<slot>`` names its
holder (attempt name and epoch); the intent records the slot. Sinks name per-attempt resources by
slot (a Kafka transactional id per slot instead of one per attempt), so their number stays bounded.

The coordinator releases (deletes) a slot once its holder is finished, that is its intent znode
is gone (every path that finishes an attempt deletes it), and its epoch is at least ``lag`` epochs
below the watermark: a margin so that a paused zombie of the holder must stay paused across that
many further commits before the slot (and its resource) passes to another attempt.

Usage::

    held = read_slots(client, qp)                           # every slot held now, pipelined reads
                                                            # (known={path: Slot}: only new ones read)
    free = releasable(client, qp, held, watermark=41, lag=1)
    txn = fence.transaction()
    for slot in free:
        txn.delete(slot.path(qp), version=slot.version)
    fence.commit(txn)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from coordinator.layout import QueryPaths
from coordinator.zk import RecordError, children, dump, parse_object, read_many
from twophase.sink import TxnContext


@dataclass(frozen=True)
class Slot:
    """One held slot: its partition and number, its holder, and the znode's version."""

    partition: int
    number: int
    attempt: str       # the holder's TxnContext.name
    epoch: int         # the holder's epoch
    version: int

    def path(self, qp: QueryPaths) -> str:
        """The slot's znode."""
        return f"{qp.partition_slots(self.partition)}/{self.number}"


def holder_data(ctx: TxnContext) -> bytes:
    """What a claimed slot's znode holds: who holds it."""
    return dump({"attempt": ctx.name, "epoch": ctx.epoch})


def intent_data(slot: int | None) -> bytes:
    """What an intent's znode holds: the slot its attempt claimed; empty if it claimed none."""
    return b"" if slot is None else dump({"slot": slot})


def slot_of_intent(raw: bytes, path: str) -> int | None:
    """The slot an intent's data names; None for an empty intent (its sink uses no slots, or it was
    written before slots existed)."""
    if not raw:
        return None
    slot = parse_object(raw, path, {}).get("slot")
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise RecordError(f"znode {path}: \"slot\" must be an integer >= 0, found {slot!r:.40}")
    return slot


def lowest_free(held: set[int]) -> int:
    """The lowest slot number not in ``held``."""
    return next(n for n in range(len(held) + 1) if n not in held)


def read_slots(client: KazooClient, qp: QueryPaths, known: Mapping[str, Slot] | None = None) -> list[Slot]:
    """Every slot of the query held now, by partition and number; reads pipelined (two round trips).

    A slot's znode never changes while it exists (a task creates it; only the app's owner deletes
    it), so the owner passes the slots it read before as ``known`` (by path): only the slots
    claimed since are read.
    """
    known = known or {}
    partitions = children(client, qp.slots)
    if bad := [p for p in partitions if not p.isdigit()]:
        raise RecordError(f"znode {qp.slots}/{bad[0]}: its name is not a partition number")
    listed = [(int(p), client.get_children_async(qp.partition_slots(int(p)))) for p in partitions]
    paths = {}
    for partition, result in listed:
        try:
            names = result.get()
        except NoNodeError:
            continue
        if bad := [n for n in names if not n.isdigit()]:
            raise RecordError(f"znode {qp.partition_slots(partition)}/{bad[0]}: its name is not a slot number")
        paths.update({(partition, int(n)): f"{qp.partition_slots(partition)}/{n}" for n in names})
    slots = [known[path] for path in paths.values() if path in known]
    unknown = {key: path for key, path in paths.items() if path not in known}
    for (partition, number), raw, stat in read_many(client, unknown):  # a slot released meanwhile is left out
        path = paths[(partition, number)]
        holder = parse_object(raw, path, {})
        attempt, epoch = holder.get("attempt"), holder.get("epoch")
        if not isinstance(attempt, str) or isinstance(epoch, bool) or not isinstance(epoch, int):
            raise RecordError(f"znode {path}: expected {{\"attempt\": name, \"epoch\": N}}, found {raw[:80]!r}")
        slots.append(Slot(partition, number, attempt, epoch, stat.version))
    return sorted(slots, key=lambda s: (s.partition, s.number))


def releasable(client: KazooClient, qp: QueryPaths, slots: list[Slot], watermark: int, lag: int) -> list[Slot]:
    """The slots whose holder is finished (its intent is gone) and at least ``lag`` epochs below
    ``watermark``; the intents are looked up pipelined."""
    old = [s for s in slots if s.epoch <= watermark - lag]
    pending = [(s, client.exists_async(f"{qp.intents(s.epoch)}/{s.attempt}")) for s in old]
    return [s for s, result in pending if result.get() is None]
