"""Signed pickles: payloads in ZooKeeper that only holders of the secret can forge.

Unpickling is code execution for whoever can write the bytes, so every pickled
payload the coordinator stores (handles, the sink itself) carries an HMAC of a
shared secret and is refused when it does not verify. The HMAC covers the znode
path the payload is stored at (which names the root and the app) as well as the
payload: a validly signed blob copied to another node (another app's sink into
this app's) does not verify there.

Usage::

    signer = Signer(load_secret())
    blob = signer.dumps({"file": "/out/part-1"}, "/twophase/apps/orders/sink")
    assert signer.loads(blob, "/twophase/apps/orders/sink") == {"file": "/out/part-1"}
    signer.verify(blob, "/twophase/apps/orders/sink")   # checks it, unpickles nothing
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

import cloudpickle

_MAGIC = b"TP2"      # HMAC over (path, payload)
_OLD_MAGIC = b"TP1"  # earlier versions: an HMAC of the payload alone, valid at any path; refused
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

    def _tag(self, path: str, payload: bytes) -> bytes:
        mac = hmac.new(self._secret, _MAGIC, _DIGEST)
        encoded = path.encode()
        mac.update(len(encoded).to_bytes(4, "big") + encoded)  # length-prefixed: path and payload cannot trade bytes
        mac.update(payload)
        return mac.digest()

    def dumps(self, obj: Any, path: str) -> bytes:
        """``obj`` cloudpickled, with the magic prefix and an HMAC-SHA256 tag over ``path`` and it in front.

        ``path`` is the znode the blob is written to; it verifies there only.
        """
        payload = cloudpickle.dumps(obj)
        return _MAGIC + self._tag(path, payload) + payload

    def verify(self, blob: bytes, path: str, what: str = "payload") -> bytes:
        """The pickled payload of a blob dumps() signed for ``path``; SignatureError if it is not one.

        Unpickles nothing, so a reader can check a blob it will not load; ``what`` names the blob in
        the error message.
        """
        head = len(_MAGIC) + _DIGEST_SIZE
        if blob.startswith(_OLD_MAGIC):
            raise SignatureError(
                f"{what} ({path}) is signed in an older format that does not bind it to its znode: "
                "re-publish it with this version (restart the app's driver); pre-commits of that format "
                "must be settled with the twophase version that wrote them")
        if len(blob) < head or not blob.startswith(_MAGIC):
            raise SignatureError(f"{what} ({path}) is not a signed twophase payload")
        tag, payload = blob[len(_MAGIC):head], blob[head:]
        if not hmac.compare_digest(tag, self._tag(path, payload)):
            raise SignatureError(
                f"{what} ({path}) has a bad signature: it was tampered with, copied from another znode "
                "(another app's), or written with a different secret (check TWOPHASE_SECRET on the "
                "driver, daemons and CLI)"
            )
        return payload

    def loads(self, blob: bytes, path: str, what: str = "payload") -> Any:
        """The object dumps() signed for ``path``; SignatureError (nothing unpickled) if it does not verify."""
        return cloudpickle.loads(self.verify(blob, path, what))
