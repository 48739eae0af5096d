"""SaslAuthenticate (key 36), v0-v2: one SASL token of the mechanism SaslHandshake picked, and the
broker's answer. SASL_AUTHENTICATION_FAILED (with Kafka's message) for wrong credentials,
ILLEGAL_SASL_STATE out of order or on a listener without SASL; the connection is closed after
either. ``session_lifetime`` is 0: no re-authentication (KIP-368) is asked for."""

from __future__ import annotations

import datetime

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles


@handles(ApiKey.SASL_AUTHENTICATE, 0, 2)
async def handle(broker, request):
    """Answer SaslAuthenticate from the connection's SASL session."""
    if request.sasl is None:
        code, message, token = ErrorCode.illegal_sasl_state, "this listener does not use SASL", b""
    else:
        code, message, token = request.sasl.authenticate(request.body.auth_bytes)
    return build(request.response_type(), error_code=code, error_message=message, auth_bytes=token,
                 session_lifetime=datetime.timedelta(0))
