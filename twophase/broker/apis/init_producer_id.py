"""InitProducerId (key 22), v0-v6: producer ids for idempotent and transactional producers.

Without a transactional id, like Kafka, a producer gets a fresh producer id with epoch 0 every
time, including when it asks to bump the epoch of the id it had (v3+, KIP-360). Ids come from a
counter persisted in the data directory, so they are never reused across restarts. With a
transactional id the transaction coordinator answers: the id's producer id with a bumped epoch
(fencing older instances, aborting what they left open), or, with v6 keep_prepared_txn
(KIP-939), the bumped epoch plus the (producer id, epoch) of the prepared transaction it keeps.
From v3 the request may carry the producer's own (id, epoch) (KIP-360): only the current pair may
bump, and the pair before it gets the current answer again (a retry whose response was lost); a
new producer id with epoch 0 once the epoch is exhausted.
"""

from __future__ import annotations

import logging
import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles
from ._common import NO_THROTTLE, NONE
from ._txn import txn_error

log = logging.getLogger("twophase.broker")


@handles(ApiKey.INIT_PRODUCER_ID, 0, 6)  # 6: KIP-939 two-phase commit
async def handle(broker, request):
    """Answer InitProducerId: a fresh producer id, or (transactional) the coordinator's producer id and epoch."""
    body, rt = request.body, request.response_type()
    if body.transactional_id is None:
        producer_id = broker.allocate_producer_id()
        log.debug("producer id %d for %s (%s)", producer_id, request.client_id, request.peer)
        return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, producer_id=producer_id, producer_epoch=0)
    if body.transactional_id == "":
        return build(rt, throttle_time=NO_THROTTLE, error_code=ErrorCode.invalid_request,
                     producer_id=-1, producer_epoch=-1)
    result = broker.transactions.init_producer_id(
        body.transactional_id, int(body.transaction_timeout.total_seconds() * 1000),
        producer_id=getattr(body, "producer_id", -1), producer_epoch=getattr(body, "producer_epoch", -1),
        enable_two_phase=getattr(body, "enable2_pc", False), keep_prepared=getattr(body, "keep_prepared_txn", False),
        now_ms=int(time.time() * 1000))
    if result.error:
        log.info("InitProducerId for transactional id %r from %s: error %d", body.transactional_id,
                 request.peer, result.error)
    return build(rt, throttle_time=NO_THROTTLE, error_code=txn_error(result.error, request),
                 producer_id=result.producer_id, producer_epoch=result.producer_epoch,
                 ongoing_txn_producer_id=result.ongoing_producer_id,
                 ongoing_txn_producer_epoch=result.ongoing_producer_epoch)
