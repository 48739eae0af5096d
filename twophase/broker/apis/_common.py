"""Small helpers shared by the API handlers."""

from __future__ import annotations

import datetime

from kio.schema.errors import ErrorCode

from twophase.wire.errors import InvalidTopicError

from ..storage import validate_topic_name

NO_THROTTLE = datetime.timedelta(0)
NONE = ErrorCode.none
READ_UNCOMMITTED, READ_COMMITTED = 0, 1  # Fetch and ListOffsets isolation levels
# "Authorized operations were not requested" (Kafka's Integer.MIN_VALUE sentinel).
OPERATIONS_OMITTED = -(2**31)


def error(code: int) -> ErrorCode:
    """The kio ErrorCode for a numeric Kafka error code (unknown codes become -1)."""
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.unknown_server_error


def valid_topic_name(name: str | None) -> bool:
    """Kafka's rules (storage enforces them): 1-249 of [a-zA-Z0-9._-], not "." or ".."."""
    try:
        validate_topic_name(name)
    except InvalidTopicError:
        return False
    return True
