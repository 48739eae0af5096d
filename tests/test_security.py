"""TLS/SASL settings and their sources (twophase.client.security), the PLAIN token (twophase.wire.security),
the broker's users file (twophase.broker.users), its SASL sessions and listener settings, and the
``broker-users`` command. No broker runs here: tests/broker/test_sasl_tls.py has the real thing."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import ssl
import stat

import pytest
import trustme
from kio.schema.errors import ErrorCode
from scramp import ScramClient

from twophase.broker import BrokerConfig
from twophase.broker.cli import main as broker_cli
from twophase.broker.security import Authenticator
from twophase.broker.users import UsersFile, add_user, read_users, remove_user, verify_password, write_users
from twophase.cli import main as twophase_cli
from twophase.client.security import PLAINTEXT, SecuritySettings, as_security, load_security
from twophase.wire.api_keys import ApiKey
from twophase.wire.security import parse_plain, plain_message

SASL_SSL = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "alice",
            "sasl.password": "s3cret-pw", "ssl.ca.location": "/etc/ca.pem"}


# -- settings ----------------------------------------------------------------------------------


def test_settings_parse_kafka_names():
    s = SecuritySettings.from_config({**SASL_SSL, "security.protocol": "sasl_ssl", "sasl.mechanism": "scram-sha-256"})
    assert (s.protocol, s.sasl_mechanism, s.sasl_username, s.sasl_password) == (
        "SASL_SSL", "SCRAM-SHA-256", "alice", "s3cret-pw")
    assert s.tls and s.sasl and s.check_hostname and s.ssl_ca_location == "/etc/ca.pem"
    assert SecuritySettings.from_config({}) == PLAINTEXT and not PLAINTEXT.tls and not PLAINTEXT.sasl
    off = SecuritySettings.from_config({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none"})
    assert not off.check_hostname and not off.sasl
    assert not SecuritySettings.from_config({"security.protocol": "SSL",
                                             "ssl.endpoint.identification.algorithm": ""}).check_hostname


@pytest.mark.parametrize("config, named", [
    ({"sasl.jaas.config": "x"}, "sasl.jaas.config"),
    ({"security.protocol": "TLS"}, "security.protocol"),
    ({**SASL_SSL, "sasl.mechanism": "GSSAPI"}, "sasl.mechanism"),
    ({**SASL_SSL, "sasl.mechanism": "OAUTHBEARER"}, "sasl.mechanism"),
    ({k: v for k, v in SASL_SSL.items() if k != "sasl.mechanism"}, "sasl.mechanism"),
    ({k: v for k, v in SASL_SSL.items() if k != "sasl.password"}, "sasl.password"),
    ({k: v for k, v in SASL_SSL.items() if k != "sasl.username"}, "sasl.username"),
    ({**SASL_SSL, "sasl.username": ""}, "sasl.username"),
    ({**SASL_SSL, "security.protocol": "SSL"}, "sasl."),             # credentials with no SASL
    ({**SASL_SSL, "security.protocol": "SASL_PLAINTEXT"}, "ssl.ca.location"),   # a CA with no TLS
    ({"security.protocol": "SSL", "ssl.certificate.location": "c.pem"}, "ssl.key.location"),
    ({"security.protocol": "SSL", "ssl.key.password": "k"}, "ssl.key.password"),
    ({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "http"},
     "ssl.endpoint.identification.algorithm"),
    ({"security.protocol": 1}, "security.protocol"),
])
def test_bad_settings_name_the_setting(config, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SecuritySettings.from_config(config)


def test_repr_and_str_never_show_passwords():
    s = SecuritySettings.from_config({"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                                      "sasl.username": "alice", "sasl.password": "pw-sasl-123",
                                      "ssl.certificate.location": "c.pem", "ssl.key.location": "k.pem",
                                      "ssl.key.password": "pw-key-456"}, source="file:/etc/client.properties")
    for shown in (repr(s), str(s), f"{s}", repr([s])):
        assert "pw-sasl-123" not in shown and "pw-key-456" not in shown
        assert "sasl.username=alice" in shown and "sasl.password=***" in shown and "ssl.key.password=***" in shown
        assert "source=file:/etc/client.properties" in shown


def test_settings_are_never_pickled():
    s = SecuritySettings.from_config({"security.protocol": "SSL"}, source="env:KAFKA_")
    with pytest.raises(TypeError, match="never pickled.*env:KAFKA_.*load_security"):
        pickle.dumps(s)


def test_as_security():
    assert as_security(None) is PLAINTEXT
    s = SecuritySettings.from_config(SASL_SSL)
    assert as_security(s) is s
    assert as_security(SASL_SSL) == s
    with pytest.raises(ValueError, match="security source must be file:PATH or env:PREFIX"):
        as_security("SASL_SSL")   # a string is a source
    with pytest.raises(TypeError, match="security must be"):
        as_security(9093)


# -- sources -----------------------------------------------------------------------------------


def test_file_source(tmp_path):
    path = tmp_path / "client.properties"
    path.write_text("# Kafka client settings\n\n! another comment\nsecurity.protocol = SASL_SSL\n"
                    "sasl.mechanism=SCRAM-SHA-512\nsasl.username: bob\nsasl.password=a=b:c\n"
                    f"ssl.ca.location={tmp_path}/ca.pem\n")
    s = load_security(f"file:{path}")
    assert (s.protocol, s.sasl_mechanism, s.sasl_username, s.sasl_password) == ("SASL_SSL", "SCRAM-SHA-512", "bob",
                                                                                   "a=b:c")
    assert s.source == f"file:{path}"


@pytest.mark.parametrize("text, message", [
    ("security.protocol=SSL\nbootstrap.servers=x:1\n", r"unknown security setting 'bootstrap\.servers' \(from file:"),
    ("security.protocol SSL\n", "line 1: expected name=value"),
    ("security.protocol=SSL\nsecurity.protocol=SASL_SSL\n", "line 2: security.protocol is set twice"),
    ("security.protocol=QUIC\n", r"security\.protocol must be one of"),
])
def test_bad_file_source(tmp_path, text, message):
    path = tmp_path / "client.properties"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_security(f"file:{path}")


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ValueError, match="nothing.properties"):
        load_security(f"file:{tmp_path}/nothing.properties")


def test_env_source(monkeypatch):
    monkeypatch.setenv("TP_SECURITY_PROTOCOL", "sasl_plaintext")
    monkeypatch.setenv("TP_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("TP_SASL_USERNAME", "carol")
    monkeypatch.setenv("TP_SASL_PASSWORD", "env-pw-321")
    monkeypatch.setenv("TP_SSL_CA_LOCATION", "")  # empty: left out, as if unset
    monkeypatch.setenv("TP_OTHER_THING", "ignored")  # not a setting's variable: never read
    s = load_security("env:TP_")
    assert (s.protocol, s.sasl_mechanism, s.sasl_username, s.sasl_password, s.ssl_ca_location) == (
        "SASL_PLAINTEXT", "PLAIN", "carol", "env-pw-321", None)
    assert s.source == "env:TP_" and "env-pw-321" not in repr(s)
    nothing = load_security("env:NOTHING_SET_")
    assert nothing.protocol == "PLAINTEXT" and nothing.source == "env:NOTHING_SET_"


@pytest.mark.parametrize("source", ["client.properties", "file:", "http://x", "vault:x", ""])
def test_bad_source(source):
    with pytest.raises(ValueError, match="file:PATH or env:PREFIX"):
        load_security(source)


# -- TLS context -------------------------------------------------------------------------------


def test_ssl_context(tmp_path):
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    s = SecuritySettings.from_config({"security.protocol": "SSL", "ssl.ca.location": str(tmp_path / "ca.pem")})
    context = s.ssl_context()
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert s.ssl_context() is context  # built once
    off = SecuritySettings.from_config({"security.protocol": "SSL", "ssl.ca.location": str(tmp_path / "ca.pem"),
                                        "ssl.endpoint.identification.algorithm": "none"}).ssl_context()
    assert off.verify_mode == ssl.CERT_REQUIRED and not off.check_hostname


def test_ssl_context_bad_ca_file_names_it(tmp_path):
    (tmp_path / "ca.pem").write_text("not a certificate")
    for path in (tmp_path / "ca.pem", tmp_path / "missing.pem"):
        s = SecuritySettings.from_config({"security.protocol": "SSL", "ssl.ca.location": str(path)})
        with pytest.raises(ValueError, match=f"ssl.ca.location '{path}'"):
            s.ssl_context()


# -- the PLAIN token ---------------------------------------------------------------------------


def test_plain_token():
    assert plain_message("alice", "pw") == b"\0alice\0pw"
    assert parse_plain(b"\0alice\0pw") == ("alice", "pw")
    assert parse_plain(b"alice\0alice\0pw") == ("alice", "pw")
    for bad in (b"alice\0pw", b"\0\0pw", b"\0alice\0", b"bob\0alice\0pw", b"\0al\xffice\0pw", b"\0a\0b\0c"):
        with pytest.raises(ValueError):
            parse_plain(bad)


# -- the users file ----------------------------------------------------------------------------


def test_users_file_stores_salted_credentials_never_the_password(tmp_path):
    path = str(tmp_path / "users.json")
    assert add_user(path, "alice", "correct horse") is True
    assert add_user(path, "bob", "correct horse") is True
    raw = (tmp_path / "users.json").read_bytes()
    assert b"correct horse" not in raw and base64.b64encode(b"correct horse") not in raw
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    users = read_users(path)
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        a, b = users["alice"][mechanism], users["bob"][mechanism]
        assert a.iterations >= 4096 and len(a.salt) >= 12
        assert a.salt != b.salt and a.stored_key != b.stored_key  # same password, different salts
        assert verify_password(a, "correct horse") and not verify_password(a, "correct horse!")
    before = users["alice"]["SCRAM-SHA-256"]
    assert add_user(path, "alice", "new password", iterations=8192) is False
    after = read_users(path)["alice"]["SCRAM-SHA-256"]
    assert after.salt != before.salt and after.iterations == 8192 and verify_password(after, "new password")
    remove_user(path, "bob")
    assert set(read_users(path)) == {"alice"}
    with pytest.raises(ValueError, match="no user 'bob'"):
        remove_user(path, "bob")


def test_credentials_are_what_scram_clients_prove(tmp_path):
    """A credential made here authenticates a SCRAM client knowing the password (RFC 5802, both hashes)."""
    path = str(tmp_path / "users.json")
    add_user(path, "alice", "pw")
    authenticator = Authenticator(UsersFile(path), ("SCRAM-SHA-256", "SCRAM-SHA-512"))
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        for password, ok in (("pw", True), ("wrong", False)):
            session = authenticator.session("peer:1")
            assert session.handshake(mechanism)[0] == ErrorCode.none
            client = ScramClient([mechanism], "alice", password)
            code, _, server_first = session.authenticate(client.get_client_first().encode())
            assert code == ErrorCode.none
            client.set_server_first(server_first.decode())
            code, message, server_final = session.authenticate(client.get_client_final().encode())
            if ok:
                assert code == ErrorCode.none and session.authenticated
                client.set_server_final(server_final.decode())  # the broker's proof verifies too
            else:
                assert code == ErrorCode.sasl_authentication_failed and session.failed
                assert f"invalid credentials with SASL mechanism {mechanism}" in message


@pytest.mark.parametrize("content, message", [
    ("[]", "expected"),
    ("not json", "not JSON"),
    ('{"users": {"a": {"SCRAM-SHA-1": {}}}}', "user 'a'"),
    ('{"users": {"a": {"SCRAM-SHA-256": {"salt": "!!", "iterations": 4096, "stored_key": "", "server_key": ""}}}}',
     "base64"),
    ('{"users": {"a": {"SCRAM-SHA-256": {"salt": "", "iterations": 10, "stored_key": "", "server_key": ""}}}}',
     "iterations"),
    ('{"users": {"a": {"SCRAM-SHA-256": {"password": "x"}}}}', "salt, iterations"),
])
def test_bad_users_file_names_it(tmp_path, content, message):
    path = tmp_path / "users.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"users file {path}.*{message}"):
        read_users(str(path))


def test_users_file_is_read_again_when_it_changes(tmp_path, caplog):
    path = str(tmp_path / "users.json")
    add_user(path, "alice", "pw")
    users = UsersFile(path)
    assert users.credential("bob", "SCRAM-SHA-256") is None
    add_user(path, "bob", "pw2")
    assert verify_password(users.credential("bob", "SCRAM-SHA-256"), "pw2")
    with open(path, "w") as f:
        f.write("{broken")
    assert users.credential("bob", "SCRAM-SHA-512") is not None  # the users before the bad change stay
    assert "not JSON" in caplog.text


def test_sasl_session_state(tmp_path):
    add_user(str(tmp_path / "users.json"), "alice", "pw")
    authenticator = Authenticator(UsersFile(str(tmp_path / "users.json")), ("PLAIN",))
    session = authenticator.session("peer:1")
    assert session.permits(ApiKey.API_VERSIONS) and session.permits(ApiKey.SASL_HANDSHAKE)
    assert not session.permits(ApiKey.METADATA) and not session.permits(ApiKey.PRODUCE)
    assert session.authenticate(b"\0alice\0pw")[0] == ErrorCode.illegal_sasl_state and session.failed
    session = authenticator.session("peer:2")
    assert session.handshake("SCRAM-SHA-256") == (ErrorCode.unsupported_sasl_mechanism, ("PLAIN",))
    assert session.failed
    session = authenticator.session("peer:3")
    assert session.handshake("PLAIN") == (ErrorCode.none, ("PLAIN",))
    assert session.authenticate(b"\0alice\0pw") == (ErrorCode.none, None, b"")
    assert session.permits(ApiKey.METADATA)
    assert session.handshake("PLAIN")[0] == ErrorCode.illegal_sasl_state


# -- the broker's listener settings ------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"security_protocol": "SASL_SSL", "ssl_certificate": "c.pem"}, "needs users_file"),
    ({"security_protocol": "SASL_PLAINTEXT"}, "needs users_file"),
    ({"security_protocol": "SSL"}, "needs ssl_certificate"),
    ({"security_protocol": "SASL_SSL", "users_file": "u.json"}, "needs ssl_certificate"),
    ({"ssl_certificate": "c.pem"}, "PLAINTEXT has no TLS"),
    ({"users_file": "u.json"}, "PLAINTEXT has no SASL"),
    ({"security_protocol": "KERBEROS"}, "security_protocol must be one of"),
    ({"security_protocol": "SASL_PLAINTEXT", "users_file": "u", "sasl_mechanisms": ("GSSAPI",)}, "sasl_mechanisms"),
    ({"security_protocol": "SASL_PLAINTEXT", "users_file": "u", "sasl_mechanisms": ()}, "sasl_mechanisms"),
])
def test_broker_config_refuses_bad_combinations(options, message):
    with pytest.raises(ValueError, match=message):
        BrokerConfig(**options)


def test_broker_config_normalizes_and_hides_the_key_password():
    config = BrokerConfig(security_protocol="sasl_ssl", ssl_certificate="c.pem", ssl_key_password="key-pw-789",
                          users_file="u.json", sasl_mechanisms=("plain", "SCRAM-SHA-512", "PLAIN"))
    assert config.security_protocol == "SASL_SSL" and config.sasl_mechanisms == ("PLAIN", "SCRAM-SHA-512")
    assert "key-pw-789" not in repr(config)


def test_broker_refuses_to_start_on_bad_files(tmp_path, capsys):
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    common = ["--data-dir", str(tmp_path / "data"), "--port", "0"]
    assert broker_cli([*common, "--security-protocol", "SASL_SSL", "--ssl-certificate", str(tmp_path / "server.pem"),
                       "--users-file", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert broker_cli([*common, "--security-protocol", "SSL", "--ssl-certificate", str(tmp_path / "none.pem")]) == 2
    assert "ssl_certificate" in capsys.readouterr().err
    assert broker_cli([*common, "--security-protocol", "SASL_SSL", "--ssl-certificate", str(tmp_path / "server.pem")]) == 2
    assert "needs users_file" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before anything was touched


# -- broker-users ------------------------------------------------------------------------------


def test_broker_users_command_reads_the_password_from_stdin(tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "users.json")
    monkeypatch.setattr("sys.stdin", io.StringIO("from-stdin-pw\n"))
    assert twophase_cli(["broker-users", "add", "--users-file", path, "alice"]) == 0
    out = capsys.readouterr().out
    assert "added user alice" in out and "from-stdin-pw" not in out
    assert verify_password(read_users(path)["alice"]["SCRAM-SHA-512"], "from-stdin-pw")
    assert twophase_cli(["broker-users", "list", "--users-file", path]) == 0
    assert capsys.readouterr().out.split()[0] == "alice"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert twophase_cli(["broker-users", "add", "--users-file", path, "bob"]) == 2
    assert "password must not be empty" in capsys.readouterr().err
    assert twophase_cli(["broker-users", "remove", "--users-file", path, "alice"]) == 0
    assert json.loads((tmp_path / "users.json").read_text()) == {"users": {}}


def test_write_users_leaves_no_readable_temporary(tmp_path):
    path = str(tmp_path / "users.json")
    write_users(path, {})
    assert sorted(os.listdir(tmp_path)) == ["users.json"]


def test_an_unknown_user_gets_the_same_salt_every_time(tmp_path):
    """The salt in the server-first message must not tell unknown users from known ones by changing."""
    from twophase.broker.security import Authenticator
    from twophase.broker.users import UsersFile, add_user

    add_user(str(tmp_path / "users.json"), "alice", "alice-pw")
    authenticator = Authenticator(UsersFile(str(tmp_path / "users.json")), ("SCRAM-SHA-256",))
    first, second = (authenticator.unknown_user("mallory", "SCRAM-SHA-256") for _ in range(2))
    assert first.salt == second.salt != authenticator.unknown_user("eve", "SCRAM-SHA-256").salt
