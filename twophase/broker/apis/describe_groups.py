"""DescribeGroups (key 15), v0-v5: state, protocol and members of each group asked for.

Authorized operations are never computed (no ACLs): they are reported as omitted.
"""

from __future__ import annotations

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE, OPERATIONS_OMITTED


@handles(ApiKey.DESCRIBE_GROUPS, 0, 5)
async def handle(broker, request):
    """Answer DescribeGroups: state, protocol and members of each group asked about."""
    rt = request.response_type()
    Described, Member = nested(rt, "DescribedGroup"), nested(rt, "DescribedGroupMember")
    groups = []
    for group_id in request.body.groups:
        state, ptype, pname, members = broker.groups.describe(group_id)
        groups.append(build(
            Described, error_code=NONE, group_id=group_id, group_state=state, protocol_type=ptype,
            protocol_data=pname, authorized_operations=OPERATIONS_OMITTED, members=tuple(
                build(Member, member_id=mid, group_instance_id=iid, client_id=cid, client_host=host,
                      member_metadata=meta, member_assignment=assignment)
                for mid, iid, cid, host, meta, assignment in members)))
    return build(rt, throttle_time=NO_THROTTLE, groups=tuple(groups))
