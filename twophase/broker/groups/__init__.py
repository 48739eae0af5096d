"""Consumer-group coordination (the classic protocol), persisted membership and committed offsets."""

from .coordinator import GroupCoordinator
from .group import ALLOWED_TRANSITIONS, Group, GroupState, IllegalTransition, JoinResult, Member, SyncResult
from .membership import MembershipStore
from .offsets import CommittedOffset, OffsetStore

__all__ = ["ALLOWED_TRANSITIONS", "CommittedOffset", "Group", "GroupCoordinator", "GroupState",
           "IllegalTransition", "JoinResult", "Member", "MembershipStore", "OffsetStore", "SyncResult"]
