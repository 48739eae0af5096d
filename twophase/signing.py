"""Signed pickles: payloads in ZooKeeper that only holders of the secret can forge.

Unpickling is code execution for whoever can write the bytes, so every pickled
payload the coordinator stores (handles, the sink itself) carries an HMAC of a
shared secret and is refused when it does not verify.

Usage::

    signer = Signer(load_secret())
    blob = signer.dumps({"file": "/out/part-1"})
    assert signer.loads(blob) == {"file": "/out/part-1"}
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

import cloudpickle

_MAGIC = b"TP1"
_DIGEST = hashlib.sha256
_DIGEST_SIZE = _DIGEST().digest_size
DEFAULT_SECRET_FILE = Path("~/.config/twophase/secret")


class SignatureError(ValueError):
    """A payload was not signed with the configured secret (tampered, or a different secret)."""


def load_secret(secret: str | bytes | None = None) -> bytes:
    """Resolve the signing secret.

    Order: the argument, $TWOPHASE_SECRET, the file named by $TWOPHASE_SECRET_FILE,
    else ~/.config/twophase/secret, created with a random secret (mode 0600) on
    first use, which suits single-host setups. Multi-host deployments pass the
    same secret to the driver, the daemons and the CLI.
    """
    if secret is None:
        secret = os.environ.get("TWOPHASE_SECRET")
    if secret is None:
        path = Path(os.environ.get("TWOPHASE_SECRET_FILE", DEFAULT_SECRET_FILE)).expanduser()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        secret = path.read_text().strip()
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < 16:
        raise ValueError("the twophase secret must be at least 16 bytes long")
    return secret


class Signer:
    """Cloudpickle with an HMAC-SHA256 tag in front."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _tag(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, _DIGEST).digest()

    def dumps(self, obj: Any) -> bytes:
        """``obj`` cloudpickled, with the magic prefix and an HMAC-SHA256 tag in front."""
        payload = cloudpickle.dumps(obj)
        return _MAGIC + self._tag(payload) + payload

    def loads(self, blob: bytes, what: str = "payload") -> Any:
        """The object dumps() signed; SignatureError if ``blob`` is not signed or its tag is wrong.

        The tag is checked before anything is unpickled; ``what`` names the blob in
        the error message.
        """
        head = len(_MAGIC) + _DIGEST_SIZE
        if len(blob) < head or not blob.startswith(_MAGIC):
            raise SignatureError(f"{what} is not a signed twophase payload")
        tag, payload = blob[len(_MAGIC):head], blob[head:]
        if not hmac.compare_digest(tag, self._tag(payload)):
            raise SignatureError(
                f"{what} has a bad signature: it was tampered with, or written with a "
                "different secret (check TWOPHASE_SECRET on the driver, daemons and CLI)"
            )
        return cloudpickle.loads(payload)
