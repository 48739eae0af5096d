"""What the transactional API handlers share: Kafka's per-version spelling of "fenced"."""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey

from ..txn.coordinator import PRODUCER_FENCED
from ._common import error

# The first version of each API that may answer PRODUCER_FENCED (90, KIP-588); older versions
# get INVALID_PRODUCER_EPOCH (47), as Kafka answers them.
PRODUCER_FENCED_SINCE = {ApiKey.INIT_PRODUCER_ID: 4, ApiKey.ADD_PARTITIONS_TO_TXN: 2, ApiKey.ADD_OFFSETS_TO_TXN: 2,
                         ApiKey.END_TXN: 2, ApiKey.TXN_OFFSET_COMMIT: 3}


def txn_error(code: int, request) -> ErrorCode:
    """The ErrorCode for ``code``; PRODUCER_FENCED is INVALID_PRODUCER_EPOCH in versions before it existed."""
    if code == PRODUCER_FENCED and request.version < PRODUCER_FENCED_SINCE[request.api.key]:
        return ErrorCode.invalid_producer_epoch
    return error(code)
