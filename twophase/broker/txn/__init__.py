"""The transaction coordinator: transactional ids, the transaction state machine and its durable log."""

from .coordinator import InitResult, TransactionCoordinator, TxnDescription, TxnSettings
from .failpoints import Failpoint
from .hanging import OpenTxn, open_transactions
from .log import TransactionLog
from .metadata import TxnMetadata
from .state import TRANSITIONS, TxnState

TXN_DIR = "transactions"  # under the broker's data directory

__all__ = ["Failpoint", "InitResult", "OpenTxn", "TRANSITIONS", "TXN_DIR", "TransactionCoordinator",
           "TransactionLog", "TxnDescription", "TxnMetadata", "TxnSettings", "TxnState", "open_transactions"]
