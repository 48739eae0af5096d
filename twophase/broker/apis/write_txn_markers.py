"""WriteTxnMarkers (key 27), v1-v2: an operator's ABORT marker for a hanging transaction (KIP-664).

In Kafka the transaction coordinator sends this to partition leaders, and ``kafka-transactions.sh
abort`` sends it to end a hanging transaction. This broker's coordinator writes its markers
directly, so the API serves only the operator's case, and only for hanging transactions
(:meth:`TransactionCoordinator.abort_hanging`): the producer must have a transaction open on the
partition (INVALID_TXN_STATE otherwise) with exactly the given epoch (INVALID_PRODUCER_EPOCH), and
the coordinator must not hold it open (CONCURRENT_TRANSACTIONS: abort it by its transactional id).
A COMMIT marker is refused (INVALID_REQUEST): an operator cannot know a transaction's data is
complete. The request's coordinator epoch is not checked: this broker's coordinator is never
re-elected, and markers carry its epoch. v2's transaction version is ignored: markers are
written as this broker's coordinator writes them (KIP-890's version 2 is not served).
"""

from __future__ import annotations

import logging
import time

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import error

log = logging.getLogger("twophase.broker")


@handles(ApiKey.WRITE_TXN_MARKERS, 1, 2)  # like Kafka 4 (no v0); 2 adds the marker's transaction version
async def handle(broker, request):
    """Answer WriteTxnMarkers: write each requested ABORT marker on each of its partitions."""
    rt = request.response_type()
    Marker, Topic = nested(rt, "WritableTxnMarkerResult"), nested(rt, "WritableTxnMarkerTopicResult")
    Partition = nested(rt, "WritableTxnMarkerPartitionResult")
    now_ms = int(time.time() * 1000)
    results = []
    for marker in request.body.markers:
        topics = []
        for topic in marker.topics:
            partitions = []
            for index in topic.partition_indexes:
                if marker.transaction_result:
                    code = ErrorCode.invalid_request
                else:
                    code = error(broker.transactions.abort_hanging(topic.name, index, marker.producer_id,
                                                                   marker.producer_epoch, now_ms))
                if code:
                    log.info("WriteTxnMarkers from %s: %s marker for producer %d epoch %d on %s-%d refused: %s",
                             request.peer, "COMMIT" if marker.transaction_result else "ABORT", marker.producer_id,
                             marker.producer_epoch, topic.name, index, code.name)
                partitions.append(build(Partition, partition_index=index, error_code=code))
            topics.append(build(Topic, name=topic.name, partitions=tuple(partitions)))
        results.append(build(Marker, producer_id=marker.producer_id, topics=tuple(topics)))
    return build(rt, markers=tuple(results))
