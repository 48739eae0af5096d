"""ListGroups (key 16), v0-v4: every group this coordinator knows (v4: filtered by state)."""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE


@handles(ApiKey.LIST_GROUPS, 0, 4)
async def handle(broker, request):
    """Answer ListGroups: every known group, filtered by state from v4."""
    rt = request.response_type()
    Listed = nested(rt, "ListedGroup")
    wanted = {s.lower() for s in getattr(request.body, "states_filter", ())}
    groups = tuple(build(Listed, group_id=gid, protocol_type=ptype, group_state=state)
                   for gid, ptype, state in broker.groups.list_groups() if not wanted or state.lower() in wanted)
    return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, groups=groups)
