"""The API registry: which Kafka APIs this broker serves, in which versions, by which handler.

Each handler module in :mod:`twophase.broker.apis` registers itself, next to its handler, with
the key and version range it serves (as franz-go's kfake does), and ``twophase.broker.apis``
imports every handler module. :data:`API_BY_KEY` is the table that results: ApiVersions
advertises exactly it and the server refuses anything outside it. The registry imports no
handler, so handlers (ApiVersions among them) can read it without an import circle.

Example::

    @handles(ApiKey.HEARTBEAT, 0, 4)
    async def handle(broker, request): ...      # a kio response object, or None for no response

    api = API_BY_KEY.get(api_key)               # None: unknown key, the connection is closed
    if api and api.supports(version):
        request_type = api.request_type(version)

Common reasons for a range (docs/kafka-protocol.md, the rest is at each registration): every
transactional API starts at 0 because aiokafka sends v0 only; ranges stop before versions that
address topics by id or need KIP-848 member epochs.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any

from kio.index import load_request_schema, load_response_schema

from twophase.wire.api_keys import ApiKey

Handler = Callable[[Any, "Request"], Awaitable[Any]]


@dataclasses.dataclass(frozen=True)
class Api:
    """One served API: its key, the version range, and the module whose ``handle`` answers it."""

    key: ApiKey
    handler: ModuleType
    min_version: int
    max_version: int

    @property
    def name(self) -> str:
        """Kafka's name of the API ("AddPartitionsToTxn")."""
        return "".join(word.capitalize() for word in self.key.name.split("_"))

    def supports(self, version: int) -> bool:
        """Whether ``version`` is in the served range."""
        return self.min_version <= version <= self.max_version

    def request_type(self, version: int) -> type:
        """The kio request class for ``version``."""
        return _request_type(self.key, version)

    def response_type(self, version: int) -> type:
        """The kio response class for ``version``."""
        return _response_type(self.key, version)


@functools.cache
def _request_type(key: int, version: int) -> type:
    return load_request_schema(key, version)


@functools.cache
def _response_type(key: int, version: int) -> type:
    return load_response_schema(key, version)


API_BY_KEY: dict[int, Api] = {}  # filled by the handler modules as twophase.broker.apis imports them


def handles(key: ApiKey, min_version: int, max_version: int) -> Callable[[Handler], Handler]:
    """Register the decorated ``handle`` of a handler module as serving ``key`` in [min, max]."""
    if not 0 <= min_version <= max_version:
        raise ValueError(f"{key.name}: bad version range {min_version}..{max_version}")

    def register(handle: Handler) -> Handler:
        module = sys.modules[handle.__module__]
        known = API_BY_KEY.get(key)
        if known is not None and known.handler is not module:
            raise RuntimeError(f"{key.name} is served by {known.handler.__name__} already")
        API_BY_KEY[key] = Api(ApiKey(key), module, min_version, max_version)
        return handle

    return register


def served() -> tuple[Api, ...]:
    """Every registered API, by key (what ApiVersions advertises)."""
    return tuple(API_BY_KEY[key] for key in sorted(API_BY_KEY))


@dataclasses.dataclass(slots=True)
class Request:
    """One decoded request as handlers see it."""

    api: Api
    version: int
    correlation_id: int
    client_id: str | None
    body: Any
    peer: str = ""
    gone: Any = None  # asyncio.Future done once the client has gone away (None outside the server)
    sasl: Any = None  # the connection's SaslSession on a SASL listener (twophase.broker.security), else None
    # Called once the response has been written (or the connection closed): say, to give back the
    # fetch budget a response's records hold.
    after_answer: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def response_type(self) -> type:
        """The kio response class for this request's API and version."""
        return self.api.response_type(self.version)
