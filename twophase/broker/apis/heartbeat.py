"""Heartbeat (key 12), v0-v4: keeps a member's session alive; REBALANCE_IN_PROGRESS tells it to rejoin,
FENCED_INSTANCE_ID (v3+) that another instance took over its group instance id."""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles
from ._common import NO_THROTTLE, error


@handles(ApiKey.HEARTBEAT, 0, 4)
async def handle(broker, request):
    """Answer Heartbeat for one group member."""
    body = request.body
    code = broker.groups.heartbeat(body.group_id, body.generation_id, body.member_id,
                                   getattr(body, "group_instance_id", None))
    return build(request.response_type(), throttle_time=NO_THROTTLE, error_code=error(code))
