"""AddOffsetsToTxn (key 25), v0-v3: include a consumer group's offsets in the open transaction."""

from __future__ import annotations

import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles
from ._common import NO_THROTTLE
from ._txn import txn_error


@handles(ApiKey.ADD_OFFSETS_TO_TXN, 0, 3)
async def handle(broker, request):
    """Answer AddOffsetsToTxn: add the consumer group to the transaction, so its offsets commit with it."""
    body, rt = request.body, request.response_type()
    if not body.group_id:
        return build(rt, throttle_time=NO_THROTTLE, error_code=ErrorCode.invalid_group_id)
    code = broker.transactions.add_offsets(body.transactional_id, body.producer_id, body.producer_epoch,
                                           body.group_id, int(time.time() * 1000))
    return build(rt, throttle_time=NO_THROTTLE, error_code=txn_error(code, request))
