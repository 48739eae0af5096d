"""DescribeTransactions (key 65), v0: state, producer id and epoch, timeout, start time and
partitions of each transactional id (TRANSACTIONAL_ID_NOT_FOUND for ids the coordinator does not know).

Kafka sends start time -1 when no transaction has started; kio (and so this project's client)
cannot decode a negative timestamp, so the epoch (0) stands for "none" here.
"""

from __future__ import annotations

import datetime

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE


def _time(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(max(ms, 0) / 1000, datetime.timezone.utc)


@handles(ApiKey.DESCRIBE_TRANSACTIONS, 0, 0)
async def handle(broker, request):
    """Answer DescribeTransactions: state, timeout, start time, producer and partitions of each transactional id."""
    rt = request.response_type()
    State, TopicData = nested(rt, "TransactionState"), nested(rt, "TopicData")
    states = []
    for tid in request.body.transactional_ids:
        d = broker.transactions.describe(tid)
        if d is None:
            states.append(build(State, error_code=ErrorCode.transactional_id_not_found, transactional_id=tid,
                                transaction_state="", transaction_timeout=datetime.timedelta(0),
                                transaction_start_time=_time(-1), producer_id=-1, producer_epoch=-1, topics=()))
            continue
        by_topic: dict[str, list[int]] = {}
        for topic, partition in d.partitions:
            by_topic.setdefault(topic, []).append(partition)
        states.append(build(State, error_code=NONE, transactional_id=tid, transaction_state=d.state,
                            transaction_timeout=datetime.timedelta(milliseconds=d.timeout_ms),
                            transaction_start_time=_time(d.start_ms), producer_id=d.producer_id,
                            producer_epoch=d.producer_epoch,
                            topics=tuple(build(TopicData, topic=t, partitions=tuple(ps))
                                         for t, ps in by_topic.items())))
    return build(rt, throttle_time=NO_THROTTLE, transaction_states=tuple(states))
