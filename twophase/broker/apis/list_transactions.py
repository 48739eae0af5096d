"""ListTransactions (key 66), v0-v2: transactional ids with producer id and state, filtered.

Filters as in Kafka: states, producer ids, v1 duration_filter (only transactions started more
than that many ms ago), v2 transactional_id_pattern (a regular expression the whole id must
match, in RE2 syntax like Kafka's RE2/J: no backreferences or lookaround, matched in linear time;
an invalid one is INVALID_REGULAR_EXPRESSION). Unknown state names come back in
unknown_state_filters.
"""

from __future__ import annotations

import time

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, error


@handles(ApiKey.LIST_TRANSACTIONS, 0, 2)
async def handle(broker, request):
    """Answer ListTransactions: the transactions matching the state, producer id, duration and id-pattern filters."""
    body, rt = request.body, request.response_type()
    Listed = nested(rt, "TransactionState")
    code, unknown, found = broker.transactions.list_transactions(
        body.state_filters, body.producer_id_filters, getattr(body, "duration_filter", -1),
        getattr(body, "transactional_id_pattern", None), int(time.time() * 1000))
    return build(rt, throttle_time=NO_THROTTLE, error_code=error(code), unknown_state_filters=tuple(unknown),
                 transaction_states=tuple(build(Listed, transactional_id=tid, producer_id=pid, transaction_state=state)
                                          for tid, pid, state in found))
