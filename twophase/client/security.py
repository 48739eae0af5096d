"""TLS and SASL settings of the client, under Kafka's (librdkafka's) own names, and where they come from.

The settings are what ``client.properties`` holds for Kafka's tools, or the dict handed to
confluent-kafka: ``security.protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), ``sasl.mechanism``
(PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), ``sasl.username``, ``sasl.password``, ``ssl.ca.location``,
``ssl.certificate.location``, ``ssl.key.location``, ``ssl.key.password`` and
``ssl.endpoint.identification.algorithm`` (``https``, the default, checks the broker's host name
against its certificate; ``none`` does not). The certificate is always verified.

Settings hold secrets, so they are never pickled (a sink pickled into ZooKeeper would carry them):
pickle their ``source`` instead, a string that says where they are read from, and call
:func:`load_security` where they are used::

    settings = load_security("file:/etc/twophase/client.properties")    # name=value lines, # comments
    settings = load_security("env:KAFKA_")      # KAFKA_SECURITY_PROTOCOL, KAFKA_SASL_PASSWORD, ...
    settings.source                             # "env:KAFKA_": safe to store
    Producer("broker:9093", security=settings)
    Producer("broker:9093", security={"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
                                      "sasl.username": "alice", "sasl.password": "...",
                                      "ssl.ca.location": "/etc/ca.pem"})
"""

from __future__ import annotations

import dataclasses
import os
import ssl
import threading
from collections.abc import Mapping

from twophase.wire.security import sasl_mechanism, security_protocol, uses_sasl, uses_tls

SETTINGS = ("security.protocol", "sasl.mechanism", "sasl.username", "sasl.password", "ssl.ca.location",
            "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
            "ssl.endpoint.identification.algorithm")
SECRET_SETTINGS = ("sasl.password", "ssl.key.password")
_ENDPOINT_IDENTIFICATION = {"https": True, "none": False, "": False}  # "" is how Java's clients say none
_ssl_contexts_lock = threading.Lock()


@dataclasses.dataclass(frozen=True, repr=False)
class SecuritySettings:
    """Validated TLS/SASL settings; build them with :meth:`from_config` (Kafka's names) or
    :func:`load_security`. ``repr`` and ``str`` never show the passwords; pickling refuses.

    Example::

        settings = SecuritySettings.from_config({"security.protocol": "SSL", "ssl.ca.location": "ca.pem"})
        settings.tls, settings.sasl            # True, False
        context = settings.ssl_context()       # verifies the broker's certificate and host name
    """

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: str | None = None
    check_hostname: bool = True
    source: str | None = None  # where they were read ("file:/etc/x.properties", "env:KAFKA_"): never a secret
    _context: list = dataclasses.field(default_factory=list, init=False, compare=False)  # the SSLContext, built once

    @classmethod
    def from_config(cls, config: Mapping[str, str], source: str | None = None) -> SecuritySettings:
        """Parse Kafka-named settings; ValueError naming the setting for an unknown name, a bad
        value, or a combination that cannot work (SASL without a username, a key without its
        certificate, TLS files with a protocol without TLS)."""
        unknown = sorted(set(config) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown security setting {unknown[0]!r}{_where(source)} "
                             f"(known: {', '.join(SETTINGS)})")
        values = {}
        for name, value in config.items():
            if not isinstance(value, str):
                raise ValueError(f"{name}{_where(source)} must be a string, not {type(value).__name__}")
            if not value and name != "ssl.endpoint.identification.algorithm":
                raise ValueError(f"{name}{_where(source)} is empty")
            values[name] = value
        protocol = security_protocol(values.get("security.protocol", "PLAINTEXT"))
        algorithm = values.get("ssl.endpoint.identification.algorithm", "https").strip().lower()
        if algorithm not in _ENDPOINT_IDENTIFICATION:
            raise ValueError(f"ssl.endpoint.identification.algorithm{_where(source)} must be https or none, "
                             f"not {values['ssl.endpoint.identification.algorithm']!r}")
        mechanism = values.get("sasl.mechanism")
        if uses_sasl(protocol):
            if mechanism is None:
                raise ValueError(f"sasl.mechanism{_where(source)} must be set for {protocol} "
                                 "(PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
            mechanism = sasl_mechanism(mechanism)
            for name in ("sasl.username", "sasl.password"):
                if name not in values:
                    raise ValueError(f"{name}{_where(source)} must be set for {protocol}")
        else:
            _refuse_with(values, "sasl.", protocol, "SASL", source)
        if not uses_tls(protocol):
            _refuse_with(values, "ssl.", protocol, "TLS", source)
        if ("ssl.certificate.location" in values) != ("ssl.key.location" in values):
            raise ValueError(f"ssl.certificate.location and ssl.key.location{_where(source)} go together "
                             "(the client's certificate and its key)")
        if "ssl.key.password" in values and "ssl.key.location" not in values:
            raise ValueError(f"ssl.key.password{_where(source)} is set without ssl.key.location")
        return cls(protocol, mechanism, values.get("sasl.username"), values.get("sasl.password"),
                   values.get("ssl.ca.location"), values.get("ssl.certificate.location"),
                   values.get("ssl.key.location"), values.get("ssl.key.password"),
                   _ENDPOINT_IDENTIFICATION[algorithm], source)

    @property
    def tls(self) -> bool:
        """Whether connections are TLS."""
        return uses_tls(self.protocol)

    @property
    def sasl(self) -> bool:
        """Whether connections authenticate with SASL."""
        return uses_sasl(self.protocol)

    def ssl_context(self) -> ssl.SSLContext:
        """The client's SSLContext (built once): the broker's certificate verified against
        ``ssl.ca.location`` (else the system's CAs), its host name too unless turned off, the
        client's certificate presented if given. ValueError naming the setting whose file is bad."""
        with _ssl_contexts_lock:
            if not self._context:
                self._context.append(self._build_context())
            return self._context[0]

    def _build_context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=self.ssl_ca_location)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"ssl.ca.location {self.ssl_ca_location!r}: cannot load CA certificates: "
                             f"{_reason(exc)}") from None
        context.check_hostname = self.check_hostname
        context.verify_mode = ssl.CERT_REQUIRED
        if self.ssl_certificate_location:
            try:
                context.load_cert_chain(self.ssl_certificate_location, self.ssl_key_location, self.ssl_key_password)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"ssl.certificate.location {self.ssl_certificate_location!r} / ssl.key.location "
                                 f"{self.ssl_key_location!r}: cannot load: {_reason(exc)}") from None
        return context

    def _shown(self) -> str:
        fields = [f"security.protocol={self.protocol}"]
        for name in SETTINGS[1:-1]:
            value = getattr(self, name.replace(".", "_"))
            if value is not None:
                fields.append(f"{name}={'***' if name in SECRET_SETTINGS else value}")
        if self.tls and not self.check_hostname:
            fields.append("ssl.endpoint.identification.algorithm=none")
        if self.source:
            fields.append(f"source={self.source}")
        return ", ".join(fields)

    def __repr__(self) -> str:
        return f"SecuritySettings({self._shown()})"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("SecuritySettings hold secrets and are never pickled: store their source "
                        f"({self.source or 'file:... or env:...'}) and call load_security(source) where they are used")


PLAINTEXT = SecuritySettings()


def as_security(security: SecuritySettings | Mapping[str, str] | str | None) -> SecuritySettings:
    """What the clients' ``security`` keyword accepts, as settings: None is PLAINTEXT, a mapping is parsed,
    a string is a source for :func:`load_security` (what objects that get pickled hold)."""
    if security is None:
        return PLAINTEXT
    if isinstance(security, SecuritySettings):
        return security
    if isinstance(security, str):
        return load_security(security)
    if isinstance(security, Mapping):
        return SecuritySettings.from_config(security)
    raise TypeError(f"security must be SecuritySettings, a mapping of Kafka settings, a source "
                    f"(file:PATH or env:PREFIX) or None, not {type(security).__name__}")


def secrets_in(config: Mapping[str, str]) -> list[str]:
    """The secret settings (passwords) ``config`` holds: what must not be stored where others read it."""
    return [name for name in SECRET_SETTINGS if config.get(name)]


def load_security(source: str) -> SecuritySettings:
    """Read settings from ``source``: ``file:PATH`` (Java-properties ``name=value`` lines, ``#`` or ``!``
    comments) or ``env:PREFIX`` (each setting from PREFIX + its name upper-cased, dots as
    underscores: ``KAFKA_SASL_PASSWORD`` for ``sasl.password`` with prefix ``KAFKA_``; unset or empty
    variables are left out). The settings remember ``source``. ValueError for a bad source or settings."""
    kind, sep, where = source.partition(":")
    if not sep or kind not in ("file", "env") or not where and kind == "file":
        raise ValueError(f"security source must be file:PATH or env:PREFIX, not {source!r}")
    if kind == "file":
        return SecuritySettings.from_config(read_properties(where), source)
    config = {name: os.environ[var] for name in SETTINGS if os.environ.get(var := env_name(where, name))}
    return SecuritySettings.from_config(config, source)


def env_name(prefix: str, setting: str) -> str:
    """The environment variable of ``setting`` under ``prefix``: ``env_name("KAFKA_", "sasl.password")``
    is ``KAFKA_SASL_PASSWORD``."""
    return prefix + setting.upper().replace(".", "_")


def read_properties(path: str) -> dict[str, str]:
    """``name=value`` (or ``name: value``) lines of a Java-style properties file; blank lines and
    ``#``/``!`` comments skipped, whitespace around names and values stripped. ValueError naming the
    file and line for a line without a separator or a name given twice; OSError if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"security settings file {path!r}: {exc.strerror or exc}") from None
    config: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#!":
            continue
        separators = [i for i in (stripped.find("="), stripped.find(":")) if i > 0]
        if not separators:
            raise ValueError(f"{path}, line {number}: expected name=value")
        name, value = stripped[:min(separators)].strip(), stripped[min(separators) + 1:].strip()
        if name in config:
            raise ValueError(f"{path}, line {number}: {name} is set twice")
        config[name] = value
    return config


def _where(source: str | None) -> str:
    return f" (from {source})" if source else ""


def _refuse_with(values: dict[str, str], prefix: str, protocol: str, what: str, source: str | None) -> None:
    """A setting of ``prefix`` with a protocol without ``what`` is a mistake (credentials sent in the
    clear, a CA file never used): refuse it."""
    given = sorted(name for name in values if name.startswith(prefix))
    if given:
        raise ValueError(f"{given[0]}{_where(source)} is set, but security.protocol {protocol} has no {what}")


def _reason(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
