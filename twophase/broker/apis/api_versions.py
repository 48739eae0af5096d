"""ApiVersions (key 18), v0-v3: the table of supported API version ranges (the registry, twophase.broker.protocol).

A request in a version above ours (kafka-python starts at v4) gets the answer librdkafka and
kafka-python expect: a v0-shaped body with UNSUPPORTED_VERSION (35) and our ranges, so they retry
with a version we speak. The ApiVersions response header is always v0 (no tagged fields), even
for v3; kio's response types already say so.
"""

from __future__ import annotations

from kio.schema.api_versions.v0.response import ApiVersionsResponse as ApiVersionsResponseV0
from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles, served
from ._common import NO_THROTTLE, NONE


def _ranges(response_type: type) -> tuple:
    entry = nested(response_type, "ApiVersion")
    return tuple(build(entry, api_key=a.key, min_version=a.min_version, max_version=a.max_version)
                 for a in served())


@handles(ApiKey.API_VERSIONS, 0, 3)  # kafka-python's v4 gets the v0-shaped UNSUPPORTED_VERSION it falls back on
async def handle(broker, request):
    """Answer ApiVersions with the version range of every API this broker handles."""
    response_type = request.response_type()
    return build(response_type, error_code=NONE, api_keys=_ranges(response_type), throttle_time=NO_THROTTLE)


def unsupported_version_response():
    """The v0 answer to an ApiVersions request in a version we do not speak."""
    return ApiVersionsResponseV0(error_code=ErrorCode.unsupported_version, api_keys=_ranges(ApiVersionsResponseV0))
