"""Consumer-group coordination (the classic protocol), persisted membership and committed offsets."""

from .coordinator import GroupCoordinator
from .group import TRANSITIONS, Group, GroupState, JoinResult, Member, SyncResult
from .membership import MembershipStore
from .offsets import CommittedOffset, OffsetStore

__all__ = ["CommittedOffset", "Group", "GroupCoordinator", "GroupState", "JoinResult", "Member",
           "MembershipStore", "OffsetStore", "SyncResult", "TRANSITIONS"]
