"""LeaveGroup (key 13), v0-v5: one member (v0-v2) or a batch of members (v3+) leave; the group rebalances.

v3+ members name their group instance id: a static member can be removed by instance id alone
(empty member id), and a replaced one gets FENCED_INSTANCE_ID.
"""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, error


@handles(ApiKey.LEAVE_GROUP, 0, 5)
async def handle(broker, request):
    """Answer LeaveGroup: remove one member (v0-v2) or several (v3+) from the group."""
    body, rt = request.body, request.response_type()
    if request.version < 3:
        [code] = broker.groups.leave(body.group_id, [body.member_id])
        return build(rt, throttle_time=NO_THROTTLE, error_code=error(code))
    codes = broker.groups.leave(body.group_id, [m.member_id for m in body.members],
                                [m.group_instance_id for m in body.members])
    MemberResponse = nested(rt, "MemberResponse")
    members = tuple(build(MemberResponse, member_id=m.member_id, group_instance_id=m.group_instance_id,
                          error_code=error(code)) for m, code in zip(body.members, codes))
    return build(rt, throttle_time=NO_THROTTLE, error_code=NONE, members=members)
