"""DescribeConfigs (key 32), v1-v4: the broker's settings under Kafka's names.

Clients read them to fit in: the log sink asks for ``transaction.max.timeout.ms`` to give its
transactions the longest timeout the broker allows (what a Kafka cluster also answers, with a
DESCRIBE_CONFIGS permission). Only the broker resource (type 4, named by its node id, or "" for
the defaults) is described; topics and other resources get INVALID_REQUEST with the reason.
"""

from __future__ import annotations

from kio.schema.errors import ErrorCode

from twophase.wire.api_keys import ApiKey
from twophase.wire.codec import build, nested

from ..protocol import handles
from ._common import NO_THROTTLE, NONE

BROKER_RESOURCE = 4
_STATIC_BROKER_CONFIG = 4  # config_source: set when the broker started, not changeable at run time
_TYPES = {bool: 1, str: 2, int: 5}  # BOOLEAN, STRING, LONG


def broker_configs(config) -> dict[str, object]:
    """The settings of ``config`` (a BrokerConfig) that clients have a use for, by Kafka's names."""
    return {
        "broker.id": config.node_id,
        "num.partitions": config.default_partitions,
        "auto.create.topics.enable": config.auto_create_topics,
        "message.max.bytes": config.max_request_bytes,
        "fetch.max.bytes": config.fetch_max_bytes,
        "connections.max.idle.ms": config.connections_max_idle_ms,
        "transaction.max.timeout.ms": config.transaction_max_timeout_ms,
        "transactional.id.expiration.ms": config.transactional_id_expiration_ms,
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": config.transaction_check_interval_ms,
        "transaction.two.phase.commit.enable": config.transaction_two_phase_commit,
    }


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@handles(ApiKey.DESCRIBE_CONFIGS, 1, 4)
async def handle(broker, request):
    """Answer DescribeConfigs for the broker resource; other resources are refused one by one."""
    rt = request.response_type()
    Result, Entry = nested(rt, "DescribeConfigsResult"), nested(rt, "DescribeConfigsResourceResult")
    configs = broker_configs(broker.config)
    results = []
    for resource in request.body.resources:
        if resource.resource_type != BROKER_RESOURCE or resource.resource_name not in ("", str(broker.node_id)):
            results.append(build(Result, error_code=ErrorCode.invalid_request, resource_type=resource.resource_type,
                                 resource_name=resource.resource_name, configs=(),
                                 error_message=f"only broker {broker.node_id}'s configs are described here"))
            continue
        keys = resource.configuration_keys
        wanted = configs if keys is None or not keys else {k: configs[k] for k in keys if k in configs}
        entries = tuple(build(Entry, name=name, value=_text(value), read_only=True, config_source=_STATIC_BROKER_CONFIG,
                              is_sensitive=False, synonyms=(), config_type=_TYPES[type(value)], documentation=None)
                        for name, value in wanted.items())
        results.append(build(Result, error_code=NONE, error_message=None, resource_type=resource.resource_type,
                             resource_name=resource.resource_name, configs=entries))
    return build(rt, throttle_time=NO_THROTTLE, results=tuple(results))
