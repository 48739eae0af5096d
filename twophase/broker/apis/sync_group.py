"""SyncGroup (key 14), v0-v5: the leader hands in the assignment; every member gets its part.

Members other than the leader wait (without blocking the loop) until the leader's SyncGroup
arrives or the group starts another rebalance (REBALANCE_IN_PROGRESS), or until their client
goes away (no answer then).
"""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles
from ._common import NO_THROTTLE, error
from .join_group import unless_gone


@handles(ApiKey.SYNC_GROUP, 0, 5)
async def handle(broker, request):
    """Answer SyncGroup with this member's assignment once the leader sent it; None if the client went away."""
    body, rt = request.body, request.response_type()
    result = await unless_gone(request, broker.groups.sync(
        body.group_id, body.generation_id, body.member_id, getattr(body, "protocol_type", None),
        getattr(body, "protocol_name", None), {a.member_id: a.assignment for a in body.assignments},
        getattr(body, "group_instance_id", None)))
    if result is None:
        return None  # the client went away while waiting for the leader
    return build(rt, throttle_time=NO_THROTTLE, error_code=error(result.error), protocol_type=result.protocol_type,
                 protocol_name=result.protocol_name, assignment=result.assignment)
