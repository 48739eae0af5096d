"""Kafka producer settings (Spark's ``kafka.``-prefixed options, prefix stripped) as LogSink arguments."""

from __future__ import annotations

import pyarrow as pa
import pytest

from examples.log_sink_query import read_topic
from sinks.log import LogSink
from sinks.log_settings import log_sink_args
from tests.broker.conftest import broker, broker_factory, topic  # noqa: F401  (fixtures)
from twophase.sink import TxnContext


@pytest.mark.parametrize("props, expected", [
    ({"bootstrap.servers": "k1:9092,k2:9092"}, {"bootstrap": "k1:9092,k2:9092"}),
    ({"linger.ms": "20"}, {"producer": {"linger_ms": 20}}),
    ({"batch.size": "0"}, {"producer": {"batch_size": 0}}),
    ({"compression.type": "ZSTD"}, {"producer": {"compression": "zstd"}}),
    ({"acks": "all"}, {"producer": {"acks": "all"}}),
    ({"acks": "-1"}, {"producer": {"acks": "all"}}),
    ({"retries": "3"}, {"producer": {"retries": 3}}),
    ({"delivery.timeout.ms": "60000"}, {"producer": {"delivery_timeout_ms": 60000}}),
    ({"delivery.timeout.ms": "1500", "linger.ms": "500", "request.timeout.ms": "1000"},
     {"producer": {"delivery_timeout_ms": 1500, "linger_ms": 500, "request_timeout_ms": 1000}}),
    ({"request.timeout.ms": " 5000 "}, {"producer": {"request_timeout_ms": 5000}}),
    ({"client.id": "spark-orders"}, {"producer": {"client_id": "spark-orders"}}),
    ({"buffer.memory": "67108864", "max.block.ms": "5000"},
     {"producer": {"buffer_memory": 64 << 20, "max_block_ms": 5000}}),
    ({"max.request.size": "1048576"}, {"producer": {"max_request_size": 1 << 20, "batch_size": 64 * 1024}}),
    ({"max.request.size": "1000", "batch.size": "16384"}, {"producer": {"max_request_size": 1000, "batch_size": 1000}}),
    ({"max.in.flight.requests.per.connection": "2"}, {"producer": {"max_in_flight": 2}}),  # at most 5 (idempotence)
    ({"enable.idempotence": "TRUE"}, {}),
    ({"transaction.timeout.ms": "900000"}, {"transaction_timeout_ms": 900000}),
    ({"security.protocol": "SSL", "ssl.ca.location": "/etc/ca.pem"},
     {"security": {"security.protocol": "SSL", "ssl.ca.location": "/etc/ca.pem"}}),
    ({}, {}),
])
def test_kafka_names_translate_to_log_sink_arguments(props, expected):
    assert log_sink_args(props) == expected


@pytest.mark.parametrize("props, message", [
    ({"foo.bar": "1"}, "kafka.foo.bar is not a producer setting twophase supports; supported: kafka.bootstrap.servers"),
    ({"buffer.memory": "0"}, "kafka.buffer.memory=0 is out of range: 1.."),
    ({"max.block.ms": "-1"}, "kafka.max.block.ms=-1 is out of range"),
    ({"transactional.id": "mine"}, "kafka.transactional.id is not supported: the sink owns its transactional ids"),
    ({"key.serializer": "x"}, "kafka.key.serializer is not supported: keys are serialized with ByteArraySerializer"),
    ({"value.serializer": "x"}, "kafka.value.serializer is not supported"),
    ({"enable.idempotence": "false"}, "kafka.enable.idempotence=false"),
    ({"acks": "1"}, "kafka.acks=1: the sink's producer is transactional and idempotent, which needs acks=all"),
    ({"linger.ms": "soon"}, "kafka.linger.ms='soon' is not a whole number of ms"),
    ({"linger.ms": "-1"}, "kafka.linger.ms=-1 is out of range"),
    ({"retries": "1.5"}, "kafka.retries='1.5' is not a whole number"),
    ({"retries": "0"}, "kafka.retries=0: the sink's producer is idempotent, which needs retries"),
    ({"request.timeout.ms": "0"}, "kafka.request.timeout.ms=0 is out of range: 1.."),
    ({"delivery.timeout.ms": "1000"}, "kafka.delivery.timeout.ms=1000 should be at least kafka.linger.ms + "
                                      "kafka.request.timeout.ms (30005)"),
    ({"transaction.timeout.ms": "99999999999"}, "kafka.transaction.timeout.ms=99999999999 is out of range"),
    ({"max.in.flight.requests.per.connection": "6"}, "kafka.max.in.flight.requests.per.connection=6 is out of range"),
    ({"compression.type": "brotli"}, "kafka.compression.type='brotli'"),
    ({"client.id": " "}, "kafka.client.id is empty"),
    ({"linger.ms": 5}, "kafka.linger.ms must be a string, not int"),
    ({"sasl.username": "u", "sasl.password": "secret"}, "kafka.sasl.password: a password in the query's options"),
    ({"ssl.key.password": "secret"}, "twophase.security option 'file:PATH' or 'env:PREFIX'"),
    ({"sasl.jaas.config": "...password=..."}, "kafka.sasl.jaas.config is not a security setting twophase supports; "
                                              "give the security settings, password included, as a source"),
    ({"ssl.truststore.location": "x.jks"}, "kafka.ssl.truststore.location is not a security setting twophase supports; "
                                           "give the CA certificates as a PEM file: kafka.ssl.ca.location"),
    ({"ssl.keystore.type": "PKCS12"}, "give the client certificate and its key as PEM files"),
    ({"ssl.cipher.suites": "x"}, "supported: kafka.security.protocol, kafka.sasl.mechanism, kafka.sasl.username, "
                                 "kafka.ssl.ca.location"),
])
def test_unsupported_or_bad_settings_are_refused_by_name(props, message):
    with pytest.raises(ValueError) as e:
        log_sink_args(props)
    assert message in str(e.value)
    assert "secret" not in str(e.value)


def test_the_prefix_in_messages_is_the_callers():
    with pytest.raises(ValueError, match=r"^producer\.linger\.ms="):
        log_sink_args({"linger.ms": "x"}, prefix="producer.")


def test_translated_settings_drive_a_real_sink(broker, topic):
    broker.create_topic(topic, 1)
    args = log_sink_args({"bootstrap.servers": broker.bootstrap, "linger.ms": "1", "batch.size": "4096",
                          "compression.type": "zstd", "acks": "all", "client.id": "settings-test",
                          "max.in.flight.requests.per.connection": "1", "enable.idempotence": "true"})
    sink = LogSink(topic=topic, columns="kafka", **args)
    txn = sink.begin_transaction(TxnContext("app", "q-1", "r1", 0, 0, 0))
    sink.write_batch(txn, pa.RecordBatch.from_pydict({"value": [f"v{i}" * 100 for i in range(200)]}))
    sink.commit(sink.pre_commit(txn))
    assert sorted(m.value() for m in read_topic(broker.bootstrap, topic)) == sorted(
        f"v{i}".encode() * 100 for i in range(200))
