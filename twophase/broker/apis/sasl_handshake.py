"""SaslHandshake (key 17), v1: a connection picks its SASL mechanism; the tokens follow in
SaslAuthenticate (v0, where raw tokens follow instead, is not served: every client since Kafka 1.0
sends v1). Answers UNSUPPORTED_SASL_MECHANISM with the enabled mechanisms for another one (and
on a listener without SASL, with none), ILLEGAL_SASL_STATE for a second handshake; either closes
the connection after the answer (twophase.broker.security)."""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build

from ..protocol import handles


@handles(ApiKey.SASL_HANDSHAKE, 1, 1)
async def handle(broker, request):
    """Answer SaslHandshake from the connection's SASL session."""
    if request.sasl is None:
        code, mechanisms = ErrorCode.unsupported_sasl_mechanism, ()
    else:
        code, mechanisms = request.sasl.handshake(request.body.mechanism)
    return build(request.response_type(), error_code=code, mechanisms=tuple(mechanisms))
