"""Two-phase commit without KIP-939: end a flushed ordinary transaction from another process.

A transaction flushed by :meth:`Producer.prepare_transaction` on a producer without ``enable_2pc``
is an ordinary Kafka transaction: its records are durable and invisible to read_committed readers,
and the broker aborts it once its transaction timeout passes, bumping the producer epoch (which
fences whoever still holds the old one). Until then any process that knows the transactional id,
producer id and epoch can end it with EndTxn: what Flink's Kafka sink does through reflection, and
what every Kafka release allows (EndTxn v0-v4; v5 is KIP-890's per-transaction epoch bump).

Completing it:

1. EndTxn with the handle's producer id and epoch. NONE: done (a retried commit that already went
   through is answered NONE too, by Kafka and by the built-in broker).
2. A fenced epoch, a wrong state or an unknown id: DescribeTransactions tells whether the handle's
   own (producer id, epoch) committed it. If so a commit is done and an abort is refused
   (INVALID_TXN_STATE); otherwise the transaction is gone: a commit raises PreparedTxnLost, naming
   what the broker holds now; an abort is done.

Example::

    handle = producer.prepare_transaction()          # producer made without enable_2pc
    store(handle.to_json())
    complete_flushed("127.0.0.1:9092", PreparedTxn.from_json(load()), commit=True)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .admin import Admin
from .cluster import CoordinatorType
from .connection import Connection
from .errors import PreparedTxnLost, TransactionUnknown, check, error_for
from .messages import message
from .security import SecuritySettings
from .transactions import PreparedTxn

log = logging.getLogger("twophase.client")

# EndTxn answers meaning "not the handle's open transaction any more": look at what the broker holds.
_NOT_OURS = frozenset({ErrorCode.producer_fenced, ErrorCode.invalid_producer_epoch, ErrorCode.invalid_txn_state,
                       ErrorCode.invalid_producer_id_mapping, ErrorCode.transactional_id_not_found})
_END_TXN_CLASSIC = 4  # v5 is KIP-890: it would bump the epoch that the handle names


def complete_flushed(bootstrap: str, handle: PreparedTxn, commit: bool, *, request_timeout_ms: int = 30_000,
                     security: SecuritySettings | Mapping[str, str] | str | None = None) -> None:
    """Commit or abort ``handle``'s flushed transaction; idempotent. Raises PreparedTxnLost when a
    commit is asked for a transaction that was aborted (its timeout passed, or a new instance of the
    id fenced it), KafkaError(INVALID_TXN_STATE) when an abort is asked for one that was committed.
    ``security``: as the Producer's."""
    tid = handle.transactional_id

    def end(conn: Connection) -> ErrorCode:
        v = conn.version(ApiKey.END_TXN, _END_TXN_CLASSIC)
        response = conn.request(message(ApiKey.END_TXN, v, transactional_id=tid, producer_id=handle.producer_id,
                                        producer_epoch=handle.producer_epoch, committed=commit))
        code = ErrorCode(response.error_code)
        if code.retriable:  # CONCURRENT_TRANSACTIONS, NOT_COORDINATOR, ...: coordinator_call tries again
            raise error_for(code, f"EndTxn({tid!r})")
        return code

    with Admin(bootstrap, request_timeout_ms=request_timeout_ms, security=security) as admin:
        code = admin.cluster.coordinator_call(tid, CoordinatorType.TRANSACTION, end, admin.request_timeout_s,
                                              f"EndTxn({tid!r})")
        if code == ErrorCode.none:
            log.info("%s of flushed transaction %s done", "commit" if commit else "abort", handle)
            return
        if code not in _NOT_OURS:
            check(code, f"EndTxn({tid!r}, {'commit' if commit else 'abort'})")
        now = admin.describe_settled(tid)
    committed = (now is not None and now.state == "CompleteCommit"
                 and (now.producer_id, now.producer_epoch) == (handle.producer_id, handle.producer_epoch))
    if commit and now is None:
        raise TransactionUnknown(f"{tid}: the coordinator no longer knows the id (EndTxn: {code.name.upper()}): "
                                 f"whether producer {handle.producer_id} epoch {handle.producer_epoch} committed "
                                 "cannot be told")
    if commit and not committed:
        held = f"{now.state} with producer {now.producer_id} epoch {now.producer_epoch}"
        raise PreparedTxnLost(f"{tid}: the transaction of producer {handle.producer_id} epoch "
                              f"{handle.producer_epoch} is no longer open (EndTxn: {code.name.upper()}; "
                              f"the broker holds {held})")
    if not commit and committed:
        raise KafkaError(f"{tid}: asked to abort, but it was already committed", ErrorCode.invalid_txn_state)

