"""LogSink on a SASL_SSL listener, both commit modes: the settings come from a source the sink names,
and no password reaches ZooKeeper, a handle or the log. An independent confluent-kafka reader with
the same Kafka settings counts every row."""

from __future__ import annotations

import json
import logging

import pytest

from examples.log_sink_query import read_topic
from sinks.log import LogSink
from tests.broker.conftest import broker_factory, topic  # noqa: F401  (fixtures)
from tests.broker.test_sasl_tls import PASSWORD, pki, settings  # noqa: F401  (pki is a fixture)
from tests.harness import Pipeline
from twophase.client import Admin, Producer
from twophase.spark.source import plan, read_range
from twophase.spark.source_offsets import OffsetPlanner
from twophase.spark.source_options import parse_options

BROKERS = {"prepared": {}, "classic": {"transaction_two_phase_commit": False, "transaction_max_timeout_ms": 60_000}}


@pytest.mark.parametrize("mode", list(BROKERS))
def test_log_sink_commits_over_sasl_ssl_with_settings_from_the_environment(
        mode, zk, zk_root, broker_factory, pki, topic, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    broker = broker_factory(security_protocol="SASL_SSL", ssl_certificate=pki.server, users_file=pki.users,
                            **BROKERS[mode])
    kafka = settings(pki, "SCRAM-SHA-512")
    for name, value in kafka.items():
        monkeypatch.setenv("ORDERS_KAFKA_" + name.upper().replace(".", "_"), value)
    sink = LogSink(broker.bootstrap, topic, key="id", security="env:ORDERS_KAFKA_")
    with Admin(broker.bootstrap, security=kafka) as admin:
        admin.create_topics({topic: 2})

    pipe = Pipeline(zk, zk_root, sink)
    for partition in range(2):
        assert pipe.task("r1", 0, partition, range(partition * 50, partition * 50 + 50))
    [handle, _] = [a.handle for a in pipe.registry.load(0)]
    assert (handle.mode, handle.security) == (mode, "env:ORDERS_KAFKA_")
    assert PASSWORD.encode() not in b"".join(zk.get(path)[0] for path in _znodes(zk, zk_root))
    pipe.barrier(0, "r1")
    pipe.coordinator().reconcile()
    assert pipe.watermark() == 0

    rows = sorted(json.loads(m.value())["id"] for m in read_topic(broker.bootstrap, topic, security=kafka))
    assert rows == list(range(100))
    assert PASSWORD not in caplog.text


def test_a_password_is_never_given_to_the_sink_itself(pki):
    with pytest.raises(ValueError, match=r"\['sasl.password'\] are secrets.*file:PATH"):
        LogSink("127.0.0.1:9093", "t", security=settings(pki))
    with pytest.raises(ValueError, match="security source"):
        LogSink("127.0.0.1:9093", "t", security="vault:kafka")
    sink = LogSink("127.0.0.1:9093", "t", security={"security.protocol": "SSL", "ssl.ca.location": pki.ca})
    assert sink.security == {"security.protocol": "SSL", "ssl.ca.location": pki.ca}


def _znodes(zk, path):
    yield path
    for child in zk.get_children(path):
        yield from _znodes(zk, f"{path}/{child}")


def test_the_source_reads_over_sasl_ssl_with_settings_from_a_file(broker_factory, pki, topic, tmp_path):
    """The twophase-kafka source's reader (what each Spark task runs) and offset planner (the driver's)."""
    broker = broker_factory(security_protocol="SASL_SSL", ssl_certificate=pki.server, users_file=pki.users)
    kafka = settings(pki, "PLAIN")
    with Admin(broker.bootstrap, security=kafka) as admin:
        admin.create_topics({topic: 1})
    with Producer(broker.bootstrap, security=kafka) as producer:
        for i in range(20):
            producer.send(topic, value=str(i).encode(), partition=0)
    properties = tmp_path / "client.properties"
    properties.write_text("".join(f"{name}={value}\n" for name, value in kafka.items()))
    options = parse_options({"kafka.bootstrap.servers": broker.bootstrap, "subscribe": topic,
                             "twophase.security": f"file:{properties}"}, streaming=False)
    assert PASSWORD not in repr(options)
    with OffsetPlanner(options) as planner:
        partitions = planner.current_partitions()
        ranges = plan(options, planner.earliest(partitions), planner.latest(partitions))
    assert [int(row["value"]) for r in ranges for batch in read_range(r) for row in batch.to_pylist()] == list(range(20))
