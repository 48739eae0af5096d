"""Building requests: a kio request of any version from its fields (those the version lacks are dropped).

Example::

    request = message(ApiKey.METADATA, 12, topics=None, allow_auto_topic_creation=False)
    topic = part(ApiKey.METADATA, 12, "MetadataRequestTopic", name="orders", topic_id=None)
"""

from __future__ import annotations

from typing import Any

from kio.index import load_request_schema

from twophase.wire.codec import build, nested


def message(api_key: int, version: int, **fields: Any) -> Any:
    """A request of ``api_key`` in ``version``; fields that version lacks are dropped."""
    return build(load_request_schema(api_key, version), **fields)


def part(api_key: int, version: int, class_name: str, /, **fields: Any) -> Any:
    """A nested entity (``class_name``) of the request of ``api_key`` in ``version``."""
    return build(nested(load_request_schema(api_key, version), class_name), **fields)
