"""Client-side transaction state (an enum with explicit allowed transitions) and the handle of a
prepared transaction.

Two kinds of refusal: :meth:`TxnStateMachine.require` is the producer's precondition check and
raises :class:`TransactionStateError` ("cannot send in transaction state ready"), an error of the
caller's; :meth:`TxnStateMachine.transition` raises :class:`~twophase.states.IllegalTransition`
for a move the table forbids, which the producer's own preconditions rule out (a bug if seen).

Example::

    state = TxnStateMachine()
    state.transition(TxnState.READY)                   # after InitProducerId
    state.require(TxnState.READY, action="begin_transaction")
    state.transition(TxnState.IN_TRANSACTION)
    state.transition(TxnState.COMMITTING)
    handle = PreparedTxn("t1", producer_id=7, producer_epoch=3)
    PreparedTxn.from_json(handle.to_json()) == handle
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from kio.schema.errors import ErrorCode

from twophase.states import Transitions
from twophase.wire.api_keys import ApiKey
from twophase.wire.errors import KafkaError

from .connection import MS, Connection
from .errors import TransactionStateError, check
from .messages import message


class TxnState(enum.Enum):
    """Where a transactional producer is: its transaction's state as the client sees it."""

    UNINITIALIZED = "uninitialized"
    READY = "ready"                      # no transaction open
    IN_TRANSACTION = "in_transaction"
    PREPARED = "prepared"                # flushed, handle given out (KIP-939); only commit/abort now
    COMMITTING = "committing"
    ABORTING = "aborting"
    ABORTABLE_ERROR = "abortable_error"  # a send failed: the transaction can only be aborted
    FATAL_ERROR = "fatal_error"          # fenced or broken: the producer must be closed


TRANSITIONS: Transitions[TxnState] = Transitions("producer transaction", {
    TxnState.UNINITIALIZED: {TxnState.READY},
    TxnState.READY: {TxnState.IN_TRANSACTION},
    TxnState.IN_TRANSACTION: {TxnState.PREPARED, TxnState.COMMITTING, TxnState.ABORTING, TxnState.ABORTABLE_ERROR},
    TxnState.PREPARED: {TxnState.COMMITTING, TxnState.ABORTING},
    TxnState.COMMITTING: {TxnState.READY, TxnState.ABORTABLE_ERROR},
    TxnState.ABORTING: {TxnState.READY},
    TxnState.ABORTABLE_ERROR: {TxnState.ABORTING},
    TxnState.FATAL_ERROR: (),
}, from_any={TxnState.FATAL_ERROR})  # fenced or broken, whatever it was doing


class TxnStateMachine:
    """A producer's current :class:`TxnState`; every change goes through :meth:`transition`."""

    def __init__(self) -> None:
        self.state = TxnState.UNINITIALIZED

    def transition(self, target: TxnState) -> None:
        """Move to ``target``; IllegalTransition if TRANSITIONS forbids it."""
        self.state = TRANSITIONS.check(self.state, target)

    def require(self, *states: TxnState, action: str) -> None:
        """TransactionStateError ("cannot ``action`` in transaction state ...") unless in one of ``states``."""
        if self.state not in states:
            raise TransactionStateError(f"cannot {action} in transaction state {self.state.value} "
                                        f"(needs {' or '.join(s.value for s in states)})")


@dataclasses.dataclass(frozen=True)
class PreparedTxn:
    """What another process needs to commit or abort a prepared transaction: plain data.

    Example::

        handle = producer.prepare_transaction()
        store(handle.to_json())                                      # durably, before voting yes
        Producer.complete_prepared(bootstrap, PreparedTxn.from_json(load()), commit=True)
    """

    transactional_id: str
    producer_id: int
    producer_epoch: int

    def to_json(self) -> str:
        """This handle as a JSON string."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PreparedTxn:
        """The handle to_json() wrote; ValueError if ``text`` is not one."""
        try:
            data = json.loads(text)
            return cls(str(data["transactional_id"]), int(data["producer_id"]), int(data["producer_epoch"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a PreparedTxn handle: {text!r} ({exc})") from None


def init_producer_id(conn: Connection, transactional_id: str | None, timeout_ms: int, *,
                     enable_2pc: bool = False, keep_prepared: bool = False) -> Any:
    """InitProducerId at the highest version both sides speak; KafkaError for an error code.

    enable_2pc and keep_prepared (KIP-939) need v6: an older broker gets a clear error, not a
    transaction that its timeout would silently abort.
    """
    v = conn.version(ApiKey.INIT_PRODUCER_ID, 6)
    if (enable_2pc or keep_prepared) and v < 6:
        raise KafkaError(f"{conn} does not support two-phase commit (InitProducerId v{v} < 6)",
                         ErrorCode.unsupported_version)
    response = conn.request(message(
        ApiKey.INIT_PRODUCER_ID, v, transactional_id=transactional_id, transaction_timeout=timeout_ms * MS,
        producer_id=-1, producer_epoch=-1, enable2_pc=enable_2pc, keep_prepared_txn=keep_prepared))
    check(response.error_code, f"InitProducerId({transactional_id!r})")
    return response
