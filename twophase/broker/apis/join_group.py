"""JoinGroup (key 11), v0-v7: join a consumer group; the answer may wait for the other members.

v4+ clients joining with an empty member id get MEMBER_ID_REQUIRED (79) and a member id, and
join again with it (KIP-394), unless they are static members (v5+ group_instance_id, KIP-345).
The first rebalance of an empty group waits ``group_initial_rebalance_delay_ms`` (broker config). v0 has no rebalance timeout: the session timeout stands in.
A parked request whose client goes away is dropped (no answer); the member then counts as not
having rejoined.
"""

from __future__ import annotations

import asyncio

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, error


def _ms(td) -> int:
    return int(td.total_seconds() * 1000)


async def unless_gone(request, coro):
    """``await coro``, or None (and ``coro`` cancelled) once the client has gone away."""
    if request.gone is None:
        return await coro
    task = asyncio.ensure_future(coro)
    try:
        await asyncio.wait({task, request.gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


@handles(ApiKey.JOIN_GROUP, 0, 7)  # 8 adds only a reason, 9 static-member assignment skipping
async def handle(broker, request):
    """Answer JoinGroup once the rebalance completes; None if the client went away meanwhile."""
    body, rt, version = request.body, request.response_type(), request.version
    session_ms = _ms(body.session_timeout)
    rebalance_ms = _ms(body.rebalance_timeout) if version >= 1 else session_ms
    result = await unless_gone(request, broker.groups.join(
        body.group_id, body.member_id, request.client_id or "", request.peer.rpartition(":")[0],
        session_ms, rebalance_ms, body.protocol_type, [(p.name, p.metadata) for p in body.protocols],
        require_known_member_id=version >= 4, group_instance_id=getattr(body, "group_instance_id", None),
        initial_rebalance_delay_ms=broker.config.group_initial_rebalance_delay_ms))
    if result is None:
        return None
    Member = nested(rt, "JoinGroupResponseMember")
    members = tuple(build(Member, member_id=mid, group_instance_id=iid, metadata=meta)
                    for mid, iid, meta in result.members)
    protocol_name = result.protocol_name
    if protocol_name is None and version < 7:
        protocol_name = ""  # nullable from v7 only
    return build(rt, throttle_time=NO_THROTTLE, error_code=error(result.error), generation_id=result.generation,
                 protocol_type=result.protocol_type, protocol_name=protocol_name, leader=result.leader,
                 skip_assignment=False, member_id=result.member_id, members=members)
