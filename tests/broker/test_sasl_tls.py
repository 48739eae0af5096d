"""TLS and SASL against the real built-in broker, with the project's client and confluent-kafka.

Certificates are made at test time (trustme): a CA, a server certificate for 127.0.0.1 and
localhost, one for another name, and a CA nobody's certificate comes from. The SASL_SSL broker
has one user, alice, in a users file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading

import pytest
import trustme
from confluent_kafka import Consumer as ConfluentConsumer
from confluent_kafka import KafkaError as ConfluentError
from confluent_kafka import Producer as ConfluentProducer

from tests.broker.conftest import WireClient, metadata_request, produce_request
from tests.broker.test_server_cli import REPO, start
from tests.client.conftest import confluent_drain, drain
from tests.waiting import wait_for
from twophase.broker.cli import main as broker_cli
from twophase.broker.users import add_user, remove_user
from twophase.client import (
    Admin,
    Consumer,
    KafkaTimeout,
    PreparedTxn,
    Producer,
    SaslAuthenticationError,
    SslAuthenticationError,
)
from twophase.client.cli import main as txns_cli
from twophase.wire.records import record_batch

MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
PASSWORD = "alice-pw-4711"


@dataclasses.dataclass
class Pki:
    ca: str                # the CA's certificate (what clients trust)
    server: str            # certificate + key for 127.0.0.1 and localhost
    other_name: str        # certificate + key for other.example only
    untrusted_ca: str      # a CA that issued none of them
    users: str             # users file: alice / PASSWORD


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    stranger.cert_pem.write_to_path(str(d / "untrusted-ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    ca.issue_cert("other.example").private_key_and_cert_chain_pem.write_to_path(str(d / "other.pem"))
    add_user(str(d / "users.json"), "alice", PASSWORD)
    return Pki(str(d / "ca.pem"), str(d / "server.pem"), str(d / "other.pem"), str(d / "untrusted-ca.pem"),
               str(d / "users.json"))


@pytest.fixture
def sasl_ssl(broker_factory, pki):
    return broker_factory(security_protocol="SASL_SSL", ssl_certificate=pki.server, users_file=pki.users)


def create_topic(bootstrap: str, security, topic: str = "t", **options) -> None:
    """An Admin call (it connects, so it authenticates)."""
    with Admin(bootstrap, security=security, **options) as admin:
        admin.create_topics({topic: 1}, exist_ok=True)


def assert_round_trip(bootstrap: str, security, topic: str) -> None:
    """The project's producer writes a record and its consumer reads it back."""
    with Producer(bootstrap, security=security) as p:
        p.send(topic, value=b"v")
        p.flush()
    with Consumer(bootstrap, security=security) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1)] == [b"v"]


def settings(pki: Pki, mechanism: str = "SCRAM-SHA-256", password: str = PASSWORD, **extra) -> dict[str, str]:
    """What a client of a Kafka cluster sets: exactly these names, for both clients."""
    return {"security.protocol": "SASL_SSL", "sasl.mechanism": mechanism, "sasl.username": "alice",
            "sasl.password": password, "ssl.ca.location": pki.ca, **extra}


# -- the project's client ----------------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_client_produces_and_consumes_transactionally(sasl_ssl, pki, topic, mechanism):
    security = settings(pki, mechanism)
    with Admin(sasl_ssl.bootstrap, security=security) as admin:
        admin.create_topics({topic: 2})
    with Producer(sasl_ssl.bootstrap, transactional_id=f"tx-{topic}", security=security) as p:
        p.init_transactions()
        p.begin_transaction()
        for i in range(10):
            p.send(topic, value=b"committed-%d" % i, key=b"%d" % i)
        p.commit_transaction()
        p.begin_transaction()
        p.send(topic, value=b"aborted")
        p.abort_transaction()
    with Producer(sasl_ssl.bootstrap, security=security) as p:
        p.send(topic, value=b"plain", partition=0)
        p.flush()
    with Consumer(sasl_ssl.bootstrap, group_id=f"g-{topic}", isolation_level="read_committed",
                  security=security) as c:
        c.subscribe([topic])  # the group's heartbeats use a connection of their own: authenticated too
        values = sorted(m.value for m in drain(c, 11))
        c.commit()
    assert values == sorted([b"committed-%d" % i for i in range(10)] + [b"plain"])


def test_complete_prepared_over_sasl_ssl(sasl_ssl, pki, topic):
    security = settings(pki, "SCRAM-SHA-512")
    with Producer(sasl_ssl.bootstrap, transactional_id=f"2pc-{topic}", enable_2pc=True, security=security) as p:
        p.init_transactions()
        p.begin_transaction()
        p.send(topic, value=b"prepared")
        handle = p.prepare_transaction()
    Producer.complete_prepared(sasl_ssl.bootstrap, PreparedTxn.from_json(handle.to_json()), commit=True,
                               security=security)
    with Consumer(sasl_ssl.bootstrap, isolation_level="read_committed", security=security) as c:
        c.assign([(topic, 0)])
        assert [m.value for m in drain(c, 1)] == [b"prepared"]


def test_wrong_password_is_a_clear_authentication_error(sasl_ssl, pki, caplog):
    caplog.set_level(logging.INFO, logger="twophase.broker")
    for mechanism in MECHANISMS:
        with pytest.raises(SaslAuthenticationError) as raised:
            create_topic(sasl_ssl.bootstrap, settings(pki, mechanism, "wrong-pw-0815"))
        message = str(raised.value)
        assert f"authentication failed for user 'alice' with mechanism {mechanism}" in message
        assert raised.value.code == 58 and "wrong-pw-0815" not in message
    assert "authentication of user 'alice' with SCRAM-SHA-512 failed" in caplog.text
    assert "127.0.0.1:" in caplog.text
    assert "wrong-pw-0815" not in caplog.text and PASSWORD not in caplog.text


def test_unknown_user_fails_like_a_wrong_password(sasl_ssl, pki):
    for mechanism in MECHANISMS:
        with pytest.raises(SaslAuthenticationError, match="user 'mallory'"):
            create_topic(sasl_ssl.bootstrap, {**settings(pki, mechanism), "sasl.username": "mallory"})


def test_untrusted_ca_is_a_clear_tls_error(sasl_ssl, pki):
    with pytest.raises(SslAuthenticationError) as raised:
        create_topic(sasl_ssl.bootstrap, settings(pki, **{"ssl.ca.location": pki.untrusted_ca}))
    message = str(raised.value)
    assert sasl_ssl.bootstrap in message and "certificate was not trusted" in message and pki.untrusted_ca in message


def test_hostname_verification_is_on_by_default(broker_factory, pki, topic):
    b = broker_factory(security_protocol="SASL_SSL", ssl_certificate=pki.other_name, users_file=pki.users)
    with pytest.raises(SslAuthenticationError, match=f"TLS to {b.bootstrap}: its certificate does not name this host"):
        create_topic(b.bootstrap, settings(pki))
    unchecked = settings(pki, **{"ssl.endpoint.identification.algorithm": "none"})
    assert_round_trip(b.bootstrap, unchecked, topic)


def test_users_added_while_running_can_log_in(sasl_ssl, pki):
    bob = {**settings(pki), "sasl.username": "bob", "sasl.password": "bob-pw"}
    with pytest.raises(SaslAuthenticationError):
        create_topic(sasl_ssl.bootstrap, bob)
    add_user(pki.users, "bob", "bob-pw")
    try:
        create_topic(sasl_ssl.bootstrap, bob)  # no restart: the broker reads the changed file
    finally:
        remove_user(pki.users, "bob")
    with pytest.raises(SaslAuthenticationError):
        create_topic(sasl_ssl.bootstrap, bob)


@pytest.mark.parametrize("protocol", ["SSL", "SASL_PLAINTEXT"])
def test_tls_only_and_sasl_only_listeners(broker_factory, pki, topic, protocol):
    if protocol == "SSL":
        b = broker_factory(security_protocol="SSL", ssl_certificate=pki.server)
        security = {"security.protocol": "SSL", "ssl.ca.location": pki.ca}
    else:
        b = broker_factory(security_protocol="SASL_PLAINTEXT", users_file=pki.users, sasl_mechanisms=("PLAIN",))
        security = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": "alice",
                    "sasl.password": PASSWORD}
    assert_round_trip(b.bootstrap, security, topic)
    if protocol == "SASL_PLAINTEXT":
        with pytest.raises(SaslAuthenticationError, match="enables PLAIN, not SCRAM-SHA-256"):
            create_topic(b.bootstrap, {**security, "sasl.mechanism": "SCRAM-SHA-256"})


def test_txns_command_reads_command_config(sasl_ssl, pki, tmp_path, capsys):
    """``twophase txns --command-config``: a Kafka client.properties file, as Kafka's tools take it."""
    config = tmp_path / "client.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in settings(pki).items()))
    assert txns_cli(["--bootstrap-server", sasl_ssl.bootstrap, "--command-config", str(config), "list"]) == 0
    assert "TRANSACTIONAL ID" in capsys.readouterr().out
    config.write_text("".join(f"{k}={v}\n" for k, v in settings(pki, password="nope").items()))
    assert txns_cli(["--bootstrap-server", sasl_ssl.bootstrap, "--command-config", str(config), "--timeout", "5",
                     "list"]) == 1
    assert "authentication failed for user 'alice'" in capsys.readouterr().err


# -- clients that do not authenticate ----------------------------------------------------------


def test_unauthenticated_clients_can_neither_produce_nor_read(sasl_ssl, pki, topic, caplog):
    caplog.set_level(logging.INFO, logger="twophase.broker")
    with Producer(sasl_ssl.bootstrap, security=settings(pki)) as p:  # something to read
        p.send(topic, value=b"secret record")
        p.flush()
    # Plain TCP to the TLS listener: the bytes are no TLS handshake, the broker drops the connection.
    with WireClient(sasl_ssl.port) as raw, pytest.raises(ConnectionError):
        raw.request(metadata_request(12, [topic]))
    # TLS, no SASL: Metadata, Produce and Fetch close the connection unanswered.
    context = ssl.create_default_context(cafile=pki.ca)
    for request in (metadata_request(12, [topic]), produce_request(topic, record_batch([(0, None, b"x", ())]))):
        with _tls_wire(sasl_ssl.port, context) as client, pytest.raises(ConnectionError):
            client.request(request)
    assert "Metadata before SASL authentication" in caplog.text and "Produce before SASL authentication" in caplog.text
    # The project's client with TLS but no SASL fails the same way (retried, then given up).
    with pytest.raises(KafkaTimeout, match="closed by the broker"):
        create_topic(sasl_ssl.bootstrap, {"security.protocol": "SSL", "ssl.ca.location": pki.ca}, topic + "-x",
                     request_timeout_ms=2000)
    assert sasl_ssl.partition_log(topic, 0).log_end_offset == 1  # nothing was written


class _tls_wire(WireClient):
    """A WireClient over TLS (no SASL)."""

    def __init__(self, port: int, context: ssl.SSLContext) -> None:
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                        server_hostname="127.0.0.1")
        self.correlation_id = 0


# -- confluent-kafka (librdkafka) --------------------------------------------------------------


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_confluent_produces_and_consumes(sasl_ssl, pki, topic, mechanism):
    conf = {"bootstrap.servers": sasl_ssl.bootstrap, **settings(pki, mechanism)}
    p = ConfluentProducer(conf)
    for i in range(5):
        p.produce(topic, value=b"c-%d" % i)
    assert p.flush(30) == 0
    c = ConfluentConsumer({**conf, "group.id": f"g-{topic}", "auto.offset.reset": "earliest",
                           "enable.auto.commit": False})
    c.subscribe([topic])
    try:
        assert sorted(m[4] for m in confluent_drain(c, 5)) == [b"c-%d" % i for i in range(5)]
    finally:
        c.close()


def _confluent_error(conf: dict) -> ConfluentError:
    """The first error librdkafka reports through its error callback for a producer of ``conf``."""
    errors: list[ConfluentError] = []
    reported = threading.Event()

    def on_error(error: ConfluentError) -> None:
        errors.append(error)
        reported.set()

    p = ConfluentProducer({**conf, "error_cb": on_error})

    def reported_yet() -> bool:
        p.poll(0.2)  # callbacks run inside poll
        return reported.is_set()

    wait_for(reported_yet, what="librdkafka's error callback")
    return errors[0]


def test_confluent_wrong_password(sasl_ssl, pki):
    error = _confluent_error({"bootstrap.servers": sasl_ssl.bootstrap, **settings(pki, "SCRAM-SHA-256", "wrong")})
    assert error.code() == ConfluentError._AUTHENTICATION
    assert "invalid credentials with SASL mechanism SCRAM-SHA-256" in error.str()


def test_confluent_untrusted_ca_and_other_host_name(broker_factory, sasl_ssl, pki):
    error = _confluent_error({"bootstrap.servers": sasl_ssl.bootstrap,
                              **settings(pki, **{"ssl.ca.location": pki.untrusted_ca})})
    assert error.code() in (ConfluentError._SSL, ConfluentError._TRANSPORT) and "certificate" in error.str()
    other = broker_factory(security_protocol="SASL_SSL", ssl_certificate=pki.other_name, users_file=pki.users)
    error = _confluent_error({"bootstrap.servers": other.bootstrap, **settings(pki)})
    assert "certificate" in error.str()
    p = ConfluentProducer({"bootstrap.servers": other.bootstrap,
                           **settings(pki, **{"ssl.endpoint.identification.algorithm": "none"})})
    p.produce("confluent-none", value=b"v")
    assert p.flush(30) == 0


# -- the command line --------------------------------------------------------------------------


def test_broker_command_serves_sasl_ssl(pki, tmp_path):
    """``twophase broker --security-protocol SASL_SSL ...`` with a users file made by ``broker-users add``;
    librdkafka connects with the settings it would use against Kafka."""
    users = tmp_path / "users.json"
    made = subprocess.run([sys.executable, "-m", "twophase.cli", "broker-users", "add", "--users-file", str(users),
                           "carol"], input="carol-pw-99\n", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert made.returncode == 0 and "added user carol" in made.stdout, made.stderr
    proc, bootstrap = start(tmp_path / "data", "--security-protocol", "sasl_ssl", "--ssl-certificate", pki.server,
                            "--users-file", str(users), "--sasl-mechanisms", "SCRAM-SHA-512")
    try:
        conf = {"bootstrap.servers": bootstrap, **settings(pki, "SCRAM-SHA-512"), "sasl.username": "carol",
                "sasl.password": "carol-pw-99"}
        p = ConfluentProducer(conf)
        p.produce("cli-sasl", value=b"v")
        assert p.flush(30) == 0
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "SASL_SSL (SCRAM-SHA-512; 1 users in" in stderr and "carol-pw-99" not in stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--security-protocol", "KERBEROS"], "--security-protocol: security.protocol must be one of"),
    (["--sasl-mechanisms", "PLAIN,GSSAPI"], "--sasl-mechanisms must be one of"),
])
def test_bad_security_arguments_are_refused(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        broker_cli(["--data-dir", str(tmp_path / "data"), *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err
