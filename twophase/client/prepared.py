"""KIP-939 resume: commit or abort a prepared transaction from its handle, in any process.

The handle (:class:`PreparedTxn`) names the transactional id and the producer id and epoch the
prepared records were written with. Completing it:

1. DescribeTransactions: if it already ended (CompleteCommit with our producer id, or gone), answer
   from that: a repeated commit or abort is a no-op, a commit of an aborted one is PreparedTxnLost.
2. Otherwise InitProducerId v6 with enable2_pc and keep_prepared_txn: a new instance of the id that
   leaves the open transaction alone and learns which (producer id, epoch) wrote it.
3. If that is the handle's, EndTxn with the new epoch commits or aborts it; if not, the prepared
   transaction is gone (aborted by a newer instance, which may have one of its own open).

Two concurrent completions fence each other; the loser starts over and finds the outcome in step 1.

Example::

    complete_prepared("127.0.0.1:9092", PreparedTxn.from_json(stored), commit=True)
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .admin import Admin
from .cluster import CoordinatorType
from .connection import Connection
from .errors import PreparedTxnLost, ProducerFenced, check
from .messages import message
from .security import SecuritySettings
from .transactions import PreparedTxn, init_producer_id

log = logging.getLogger("twophase.client")

_ENDED_STATES = ("CompleteAbort", "CompleteCommit", "Empty", "Dead")
_ATTEMPTS = 5  # starts over after being fenced by a concurrent completion


def complete_prepared(bootstrap: str, handle: PreparedTxn, commit: bool, *, request_timeout_ms: int = 30_000,
                      security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
    """Commit or abort ``handle``'s transaction; idempotent. Raises PreparedTxnLost when a commit is
    asked for a transaction that was aborted or replaced, KafkaError(INVALID_TXN_STATE) when an abort
    is asked for one that was committed. ``security``: as the Producer's."""
    with Admin(bootstrap, request_timeout_ms=request_timeout_ms, security=security) as admin:
        for attempt in range(_ATTEMPTS):
            if _settled(admin, handle, commit):
                return
            try:
                _take_over_and_end(admin, handle, commit)
                log.info("%s of prepared transaction %s done", "commit" if commit else "abort", handle)
                return
            except ProducerFenced as exc:
                if attempt == _ATTEMPTS - 1:
                    raise
                log.info("completing %s raced with another instance (%s): looking again", handle, exc)
                time.sleep(random.uniform(0.05, 0.2))  # let the winner finish its EndTxn first


def _settled(admin: Admin, handle: PreparedTxn, commit: bool) -> bool:
    """True if the transaction already ended the way asked; PreparedTxnLost or INVALID_TXN_STATE if it
    ended the other way; False if it may still be open."""
    described = admin.describe_settled(handle.transactional_id)
    if described is None:
        if commit:
            raise PreparedTxnLost(f"{handle.transactional_id}: the coordinator does not know this transactional id")
        return True
    ours = described.producer_id == handle.producer_id
    if described.state == "CompleteCommit" and ours:
        if commit:
            return True
        raise KafkaError(f"{handle.transactional_id}: asked to abort, but it was already committed",
                         ErrorCode.invalid_txn_state)
    if not ours or described.state in _ENDED_STATES:
        if commit:
            raise PreparedTxnLost(f"{handle.transactional_id}: prepared transaction of producer {handle.producer_id} "
                                  f"is gone (now {described.state}, producer {described.producer_id})")
        return True
    return False


def _take_over_and_end(admin: Admin, handle: PreparedTxn, commit: bool) -> None:
    tid = handle.transactional_id
    cluster = admin.cluster

    def init(conn: Connection):
        return init_producer_id(conn, tid, 60_000, enable_2pc=True, keep_prepared=True)

    taken = cluster.coordinator_call(tid, CoordinatorType.TRANSACTION, init, admin.request_timeout_s,
                                     f"InitProducerId({tid!r})")
    ongoing = (int(taken.ongoing_txn_producer_id), int(taken.ongoing_txn_producer_epoch))
    if ongoing != (handle.producer_id, handle.producer_epoch):
        # It ended between the two looks, or a newer instance's transaction is open: not ours to end
        # (the prepared data was written with the handle's epoch).
        if not _settled(admin, handle, commit):
            raise PreparedTxnLost(f"{tid}: the ongoing transaction is producer {ongoing[0]} epoch {ongoing[1]}, "
                                  f"not the prepared {handle.producer_id}/{handle.producer_epoch}")
        return

    def end(conn: Connection) -> None:
        v = conn.version(ApiKey.END_TXN, 5)
        response = conn.request(message(ApiKey.END_TXN, v, transactional_id=tid, producer_id=int(taken.producer_id),
                                        producer_epoch=int(taken.producer_epoch), committed=commit))
        check(response.error_code, f"EndTxn({'commit' if commit else 'abort'})")

    cluster.coordinator_call(tid, CoordinatorType.TRANSACTION, end, admin.request_timeout_s, f"EndTxn({tid!r})")
