"""FindCoordinator (key 10), v0-v4: this broker coordinates every group and every transactional id.

v0-v3 ask for one key; v4 batches keys (coordinator_keys) and answers one Coordinator each.
Key types: 0 group, 1 transaction; anything else is INVALID_REQUEST.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE


@handles(ApiKey.FIND_COORDINATOR, 0, 4)
async def handle(broker, request):
    """Answer FindCoordinator: this broker coordinates every group and transactional id."""
    body, rt = request.body, request.response_type()
    key_type = getattr(body, "key_type", 0)
    code = NONE if key_type in (0, 1) else ErrorCode.invalid_request
    node, host, port = (broker.node_id, broker.advertised_host, broker.port) if code == NONE else (-1, "", -1)
    if request.version >= 4:
        Coordinator = nested(rt, "Coordinator")
        return build(rt, throttle_time=NO_THROTTLE, coordinators=tuple(
            build(Coordinator, key=key, node_id=node, host=host, port=port, error_code=code, error_message=None)
            for key in body.coordinator_keys))
    return build(rt, throttle_time=NO_THROTTLE, error_code=code, error_message=None,
                 node_id=node, host=host, port=port)
