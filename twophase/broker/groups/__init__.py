"""Consumer-group coordination (the classic protocol) and committed offsets."""

from .coordinator import GroupCoordinator
from .group import ALLOWED_TRANSITIONS, Group, GroupState, IllegalTransition, JoinResult, Member, SyncResult
from .offsets import CommittedOffset, OffsetStore

__all__ = ["ALLOWED_TRANSITIONS", "CommittedOffset", "Group", "GroupCoordinator", "GroupState",
           "IllegalTransition", "JoinResult", "Member", "OffsetStore", "SyncResult"]
