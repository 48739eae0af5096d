"""DeleteTopics (key 20), v1-v6: delete topics by name (v1-v5) or by name or topic id (v6).

A v6 entry names a topic either by name or by id, never both (Kafka answers INVALID_REQUEST: a name
with the id of a deleted predecessor must not delete the topic recreated under that name).
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested
from twophase.wire.errors import KafkaError

from ..protocol import handles
from ._common import NO_THROTTLE, error


@handles(ApiKey.DELETE_TOPICS, 1, 6)
async def handle(broker, request):
    """Answer DeleteTopics: delete each topic named by name (v1-v5) or by name or id (v6); one result per topic."""
    body, rt = request.body, request.response_type()
    Result = nested(rt, "DeletableTopicResult")
    if request.version >= 6:
        wanted = [(t.name, t.topic_id) for t in body.topics]  # a zero id decodes as None
    else:
        wanted = [(name, None) for name in body.topic_names]
    results = []
    for name, topic_id in wanted:
        if (name is None) == (topic_id is None):
            message = ("You may not specify both topic name and topic id." if name is not None
                       else "Neither topic name nor id were specified.")
            results.append(build(Result, name=name, topic_id=topic_id, error_code=ErrorCode.invalid_request,
                                 error_message=message))
            continue
        known = broker.topics()
        if name is None:
            match = [n for n, info in known.items() if info.topic_id == topic_id]
            if not match:
                results.append(build(Result, name=None, topic_id=topic_id, error_code=ErrorCode.unknown_topic_id,
                                     error_message=f"no topic with id {topic_id}"))
                continue
            name = match[0]
        info = known.get(name)
        if info is None:
            results.append(build(Result, name=name, topic_id=topic_id, error_code=ErrorCode.unknown_topic_or_partition,
                                 error_message=f"no topic {name!r}"))
            continue
        try:
            broker.delete_topic(name)
            code, message = ErrorCode.none, None
        except KafkaError as exc:
            code, message = error(exc.code), str(exc)
        results.append(build(Result, name=name, topic_id=info.topic_id, error_code=code, error_message=message))
    return build(rt, throttle_time=NO_THROTTLE, responses=tuple(results))
