"""Consumer-group APIs over the wire with hand-built requests: versions, shapes and error codes."""

from __future__ import annotations

import datetime

import pytest

from tests.waiting import wait_until

from .conftest import MS, WireClient, create_topics_request, req, sub

NONE, ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID, REBALANCE_IN_PROGRESS, MEMBER_ID_REQUIRED = 0, 22, 25, 27, 79
UNKNOWN_TOPIC_OR_PARTITION, INVALID_GROUP_ID = 3, 24


@pytest.fixture
def broker(broker_factory):
    # No initial rebalance delay: these groups form one member at a time (test_groups_membership tests the delay).
    return broker_factory(group_initial_rebalance_delay_ms=0)


def join_request(version: int, group: str, member_id: str = "", session_ms: int = 10_000,
                 rebalance_ms: int = 10_000):
    protocol = sub(11, version, "JoinGroupRequestProtocol", name="range", metadata=b"\x00\x01")
    return req(11, version, group_id=group, session_timeout=session_ms * MS, rebalance_timeout=rebalance_ms * MS,
               member_id=member_id, group_instance_id=None, protocol_type="consumer", protocols=(protocol,),
               reason=None)


def sync_request(version: int, group: str, generation: int, member_id: str, assignments=()):
    entries = tuple(sub(14, version, "SyncGroupRequestAssignment", member_id=m, assignment=a) for m, a in assignments)
    return req(14, version, group_id=group, generation_id=generation, member_id=member_id, group_instance_id=None,
               protocol_type="consumer", protocol_name="range", assignments=entries)


def heartbeat_request(version: int, group: str, generation: int, member_id: str):
    return req(12, version, group_id=group, generation_id=generation, member_id=member_id, group_instance_id=None)


def commit_request(version: int, group: str, generation: int, member_id: str, topic: str, offsets: dict):
    parts = tuple(sub(8, version, "OffsetCommitRequestPartition", partition_index=p, committed_offset=o,
                      committed_leader_epoch=-1, committed_metadata="meta", commit_timestamp=-1)
                  for p, o in offsets.items())
    return req(8, version, group_id=group, generation_id_or_member_epoch=generation, member_id=member_id,
               group_instance_id=None, retention_time=datetime.timedelta(milliseconds=-1),
               topics=(sub(8, version, "OffsetCommitRequestTopic", name=topic, partitions=parts),))


def fetch_offsets_request(version: int, group: str, topic: str | None, partitions=()):
    topics = None if topic is None else (
        sub(9, version, "OffsetFetchRequestTopic", name=topic, partition_indexes=tuple(partitions)),)
    return req(9, version, group_id=group, topics=topics, require_stable=False)


def full_join(client: WireClient, version: int, group: str):
    first = client.request(join_request(version, group))
    if version >= 4:
        assert first.error_code.value == MEMBER_ID_REQUIRED and first.member_id
        first = client.request(join_request(version, group, first.member_id))
    assert first.error_code.value == NONE
    return first


def test_join_sync_heartbeat_leave_in_every_version(wire, topic):
    for version in range(0, 8):
        group = f"{topic}-v{version}"
        c = wire()
        joined = full_join(c, version, group)
        assert joined.generation_id == 1 and joined.leader == joined.member_id
        sync_version = min(version, 5)
        synced = c.request(sync_request(sync_version, group, 1, joined.member_id, [(joined.member_id, b"A")]))
        assert synced.error_code.value == NONE and synced.assignment == b"A"
        hb_version = min(version, 4)
        assert c.request(heartbeat_request(hb_version, group, 1, joined.member_id)).error_code.value == NONE
        assert c.request(heartbeat_request(hb_version, group, 0, joined.member_id)).error_code.value == \
            ILLEGAL_GENERATION
        assert c.request(heartbeat_request(hb_version, group, 1, "stranger")).error_code.value == UNKNOWN_MEMBER_ID
        leave_version = min(version, 5)
        if leave_version < 3:
            left = c.request(req(13, leave_version, group_id=group, member_id=joined.member_id))
            assert left.error_code.value == NONE
        else:
            member = sub(13, leave_version, "MemberIdentity", member_id=joined.member_id, group_instance_id=None,
                         reason=None)
            left = c.request(req(13, leave_version, group_id=group, members=(member,)))
            assert left.error_code.value == NONE and left.members[0].error_code.value == NONE
        assert c.request(heartbeat_request(hb_version, group, 1, joined.member_id)).error_code.value == \
            UNKNOWN_MEMBER_ID


def test_heartbeat_reports_rebalance_and_parked_join_of_a_vanished_client_is_dropped(wire, topic):
    group = f"{topic}-g"
    a = wire()
    joined = full_join(a, 5, group)
    a.request(sync_request(5, group, 1, joined.member_id, [(joined.member_id, b"")]))
    b = wire()
    # Rebalance timeout and session far beyond the client's 10 s socket timeout: a rejoin that waited for
    # either of them would fail with a socket timeout instead of being answered.
    b_first = b.request(join_request(5, group, session_ms=120_000, rebalance_ms=120_000))
    b.send(join_request(5, group, b_first.member_id, session_ms=120_000, rebalance_ms=120_000))  # parks
    wait_until(lambda: a.request(heartbeat_request(4, group, 1, joined.member_id)).error_code.value
               == REBALANCE_IN_PROGRESS, timeout=30, what="b's join starting a rebalance")
    b.close()  # b goes away while parked: it leaves the group with its connection
    rejoined = a.request(join_request(5, group, joined.member_id, rebalance_ms=120_000))
    assert rejoined.error_code.value == NONE and rejoined.generation_id >= 2
    assert [m.member_id for m in rejoined.members] == [joined.member_id]


def test_offset_commit_and_fetch_versions(wire, broker, topic):
    c = wire()
    c.request(create_topics_request((topic, 2, 1, None)))
    group = f"{topic}-offsets"
    for version in range(2, 9):
        response = c.request(commit_request(version, group, -1, "", topic, {0: 10 + version, 1: 20 + version}))
        assert [p.error_code.value for p in response.topics[0].partitions] == [NONE, NONE]
    bad = c.request(commit_request(8, group, -1, "", topic, {5: 1}))
    assert bad.topics[0].partitions[0].error_code.value == UNKNOWN_TOPIC_OR_PARTITION
    stale = c.request(commit_request(8, group, 4, "someone", topic, {0: 1}))
    assert stale.topics[0].partitions[0].error_code.value == ILLEGAL_GENERATION
    for version in range(1, 8):
        fetched = c.request(fetch_offsets_request(version, group, topic, [0, 1, 2]))
        assert [(p.partition_index, p.committed_offset) for p in fetched.topics[0].partitions] == \
            [(0, 18), (1, 28), (2, -1)]
        assert fetched.topics[0].partitions[0].metadata == "meta"
    everything = c.request(fetch_offsets_request(7, group, None))
    assert [(t.name, [p.committed_offset for p in t.partitions]) for t in everything.topics] == [(topic, [18, 28])]
    assert c.request(commit_request(8, "", -1, "", topic, {0: 1})).topics[0].partitions[0].error_code.value == \
        INVALID_GROUP_ID


def test_deleting_a_topic_forgets_its_committed_offsets(wire, topic):
    c = wire()
    c.request(create_topics_request((topic, 1, 1, None)))
    group = f"{topic}-del"
    assert c.request(commit_request(8, group, -1, "", topic, {0: 5})).topics[0].partitions[0].error_code.value == NONE
    deleted = c.request(req(20, 6, topics=(sub(20, 6, "DeleteTopicState", name=topic, topic_id=None),),
                            topic_names=(topic,), timeout=10_000 * MS))
    assert deleted.responses[0].error_code.value == NONE
    c.request(create_topics_request((topic, 1, 1, None)))
    fetched = c.request(fetch_offsets_request(7, group, topic, [0]))
    assert fetched.topics[0].partitions[0].committed_offset == -1


def test_list_and_describe_groups_versions(wire, topic):
    c = wire()
    group = f"{topic}-desc"
    joined = full_join(c, 5, group)
    c.request(sync_request(5, group, 1, joined.member_id, [(joined.member_id, b"ASSIGN")]))
    for version in range(0, 5):
        listed = c.request(req(16, version, states_filter=("Stable",)))
        assert (group, "Stable") in {(g.group_id, getattr(g, "group_state", "Stable")) for g in listed.groups}
    for version in range(0, 6):
        [described] = c.request(req(15, version, groups=(group,), include_authorized_operations=False)).groups
        assert (described.group_state, described.protocol_type, described.protocol_data) == \
            ("Stable", "consumer", "range")
        assert [(m.member_id, m.member_assignment) for m in described.members] == [(joined.member_id, b"ASSIGN")]
