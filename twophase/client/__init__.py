"""The project's own lean Kafka client: producer (idempotent, transactional, KIP-939 prepare and
resume), consumer (assign or subscribe, read_committed), admin (topics, transactions).

It exists because no Python Kafka client lets another process commit a prepared transaction.

Example::

    from twophase.client import Producer, Consumer, Admin, PreparedTxn

    p = Producer("127.0.0.1:9092", transactional_id="t1", enable_2pc=True)
    p.init_transactions(); p.begin_transaction()
    p.send("topic", value=b"v", key=b"k")
    handle = p.prepare_transaction()
    Producer.complete_prepared("127.0.0.1:9092", PreparedTxn.from_json(handle.to_json()), commit=True)
"""

from twophase.wire.errors import KafkaError

from .admin import Admin, TransactionDescription, TransactionListing
from .consumer import EARLIEST, LATEST, Consumer, Message
from .errors import (
    AuthenticationError,
    CorruptRecordBatch,
    KafkaConnectionError,
    KafkaTimeout,
    OffsetOutOfRange,
    PreparedTxnLost,
    ProducerFenced,
    SaslAuthenticationError,
    SslAuthenticationError,
    TransactionStateError,
    TransactionUnknown,
)
from .producer import Producer
from .security import SecuritySettings, load_security
from .transactions import PreparedTxn

__all__ = [
    "EARLIEST", "LATEST", "Admin", "AuthenticationError", "Consumer", "CorruptRecordBatch", "KafkaConnectionError", "KafkaError", "KafkaTimeout",
    "Message", "OffsetOutOfRange", "PreparedTxn",
    "PreparedTxnLost", "Producer", "ProducerFenced", "SaslAuthenticationError", "SecuritySettings",
    "SslAuthenticationError", "TransactionDescription", "TransactionListing", "TransactionStateError", "TransactionUnknown",
    "load_security",
]
