"""What the transactional API handlers share: Kafka's per-version spelling of "fenced"."""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from ..txn.coordinator import PRODUCER_FENCED
from ._common import error

# The first version of each API that may answer PRODUCER_FENCED (90, KIP-588); older versions
# get INVALID_PRODUCER_EPOCH (47), as Kafka answers them.
PRODUCER_FENCED_SINCE = {22: 4, 24: 2, 25: 2, 26: 2, 28: 3}


def txn_error(code: int, request) -> ErrorCode:
    if code == PRODUCER_FENCED and request.version < PRODUCER_FENCED_SINCE[request.api.key]:
        return ErrorCode.invalid_producer_epoch
    return error(code)
