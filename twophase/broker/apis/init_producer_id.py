"""InitProducerId (key 22): producer ids for idempotent producers.

Like Kafka, a non-transactional producer gets a fresh producer id with epoch 0 every time,
including when it asks to bump the epoch of the id it had (v3+, KIP-360). Ids are allocated
from a counter persisted in the data directory, so they are never reused across restarts.
Transactional ids are refused with INVALID_REQUEST until the broker implements transactions.
"""

from __future__ import annotations

import logging

from kio.schema.errors import ErrorCode

from ..codec import build
from ._common import NO_THROTTLE, NONE

log = logging.getLogger("twophase.broker")


async def handle(broker, request):
    body, rt = request.body, request.response_type()
    if body.transactional_id is not None:
        log.warning("refusing InitProducerId for transactional id %r from %s: transactions are not supported yet",
                    body.transactional_id, request.peer)
        return build(rt, throttle_time=NO_THROTTLE, error_code=ErrorCode.invalid_request,
                     producer_id=-1, producer_epoch=-1)
    producer_id = broker.allocate_producer_id()
    log.debug("producer id %d for %s (%s)", producer_id, request.client_id, request.peer)
    return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, producer_id=producer_id, producer_epoch=0)
