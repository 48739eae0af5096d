"""Admin topic operations against the real broker, checked through confluent-kafka's admin client."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient

from twophase.client import Admin, KafkaError


def _confluent_topics(broker) -> dict[str, int]:
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10)
    return {name: len(t.partitions) for name, t in metadata.topics.items()}


def test_create_and_delete_topics(broker, topic):
    with Admin(broker.bootstrap) as admin:
        admin.create_topics({topic: 4, topic + "-x": 1})
        assert _confluent_topics(broker)[topic] == 4
        with pytest.raises(KafkaError, match="TOPIC_ALREADY_EXISTS"):
            admin.create_topics({topic: 4})
        admin.create_topics({topic: 4}, exist_ok=True)
        with pytest.raises(KafkaError, match="INVALID_PARTITIONS"):
            admin.create_topics({topic + "-bad": 0})
        admin.delete_topics([topic, topic + "-x"])
        assert topic not in _confluent_topics(broker)
        with pytest.raises(KafkaError, match="no such topic"):
            admin.delete_topics([topic])


def test_list_and_describe_know_nothing_on_a_fresh_broker(broker):
    with Admin(broker.bootstrap) as admin:
        assert admin.list_transactions() == []
        with pytest.raises(KafkaError, match="TRANSACTIONAL_ID_NOT_FOUND"):
            admin.describe_transactions(["nobody"])
