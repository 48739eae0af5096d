"""EndTxn (key 26), v0-v4: commit or abort the open transaction.

Answered once the decision is durable in the transaction log and, normally, every marker is
written. A retry of an EndTxn that already completed the same way succeeds; the opposite outcome
is INVALID_TXN_STATE. v5 (KIP-890 epoch bump per transaction) is not served.
"""

from __future__ import annotations

import time

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles
from ._common import NO_THROTTLE
from ._txn import txn_error


@handles(ApiKey.END_TXN, 0, 4)  # 5 is KIP-890's epoch bump per transaction
async def handle(broker, request):
    """Answer EndTxn: commit or abort the producer's transaction."""
    body, rt = request.body, request.response_type()
    code = broker.transactions.end_txn(body.transactional_id, body.producer_id, body.producer_epoch,
                                       body.committed, int(time.time() * 1000))
    return build(rt, throttle_time=NO_THROTTLE, error_code=txn_error(code, request))
