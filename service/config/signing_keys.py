"""Evidence signing keys as the operator configures them: the private key that signs the
evidence log's checkpoints (and manifests), and the public keys that verify them.

Keys: the private key from a PEM file (`openssl genpkey -algorithm ed25519`) or base64 of
its 32 raw bytes, from SWEEPER_EVIDENCE_SIGNING_KEY_FILE or SWEEPER_EVIDENCE_SIGNING_KEY;
never logged or rendered. A key's id is the first 16 hex digits of the SHA-256 of its raw
public key. Earlier public keys stay published (SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS) so
exports and checkpoints signed before a rotation still verify. With the embedded database
(local use) and no key configured, a key is created once under SWEEPER_DATA_DIR;
otherwise, with no key, checkpoints and manifests are unsigned and verification says so.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger(__name__)

KEY_ID_HEX: Final = 16
LOCAL_KEY_FILE: Final = "evidence-signing-key.pem"


class KeyProblem(ValueError):
    """A key that cannot be read; the message never quotes the key."""


def signed_bytes(statement: Mapping[str, Any]) -> bytes:
    """The bytes a manifest's (or a checkpoint's) signature is over: its canonical JSON."""
    return json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """The id a manifest names its key by."""
    return hashlib.sha256(_raw_public(key)).hexdigest()[:KEY_ID_HEX]


@dataclass(frozen=True)
class PublicKey:
    """A published verification key."""

    key: Ed25519PublicKey = field(repr=False)

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    @property
    def base64(self) -> str:
        return base64.b64encode(_raw_public(self.key)).decode()

    @property
    def pem(self) -> str:
        return self.key.public_bytes(serialization.Encoding.PEM,
                                     serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@dataclass(frozen=True)
class Signer:
    """The current signing key and the public keys published beside it (current first)."""

    private: Ed25519PrivateKey = field(repr=False)
    previous: tuple[PublicKey, ...] = ()

    @property
    def current(self) -> PublicKey:
        return PublicKey(self.private.public_key())

    @property
    def published(self) -> list[PublicKey]:
        current = self.current
        return [current, *(k for k in self.previous if k.key_id != current.key_id)]

    def sign(self, payload: bytes) -> str:
        return base64.b64encode(self.private.sign(payload)).decode()


def b64decode(text: str) -> bytes | None:
    """Bytes from base64 (standard or URL-safe, padding optional), None if it is not."""
    try:
        return base64.b64decode(text.strip() + "=" * (-len(text.strip()) % 4),
                                altchars=b"-_" if ("-" in text or "_" in text) else None,
                                validate=True)
    except (binascii.Error, ValueError):
        return None


def private_key(text: bytes) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS#8, unencrypted) or base64 of 32 raw bytes."""
    if b"-----BEGIN" in text:
        try:
            key = serialization.load_pem_private_key(text, password=None)
        except (ValueError, TypeError):
            raise KeyProblem("not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyProblem("not an Ed25519 key")
        return key
    raw = b64decode(text.decode("ascii", "replace"))
    if raw is None or len(raw) != 32:
        raise KeyProblem("neither PEM nor base64 of 32 bytes")
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_keys(text: bytes) -> list[PublicKey]:
    """Verification keys from a PEM public key (or several), base64 of 32 raw bytes (one
    per line or comma-separated), or the JSON `GET /v1/evidence/public-key` answers."""
    stripped = text.strip()
    if stripped.startswith(b"{"):
        try:
            doc = json.loads(stripped)
            texts = [k["public_key"] for k in doc["keys"]]
        except (ValueError, KeyError, TypeError):
            raise KeyProblem("JSON without keys[].public_key") from None
        return [_public_fromb64decode(t) for t in texts]
    if b"-----BEGIN" in stripped:
        keys = []
        for block in stripped.split(b"-----END PUBLIC KEY-----"):
            if block.strip():
                try:
                    key = serialization.load_pem_public_key(block + b"-----END PUBLIC KEY-----")
                except ValueError:
                    raise KeyProblem("not a PEM public key") from None
                if not isinstance(key, Ed25519PublicKey):
                    raise KeyProblem("not an Ed25519 key")
                keys.append(PublicKey(key))
        return keys
    parts = [p for p in stripped.decode("ascii", "replace").replace(",", "\n").split() if p]
    if not parts:
        raise KeyProblem("no key")
    return [_public_fromb64decode(p) for p in parts]


def _public_fromb64decode(text: object) -> PublicKey:
    raw = b64decode(text) if isinstance(text, str) else None
    if raw is None or len(raw) != 32:
        raise KeyProblem("a public key is neither PEM nor base64 of 32 bytes")
    return PublicKey(Ed25519PublicKey.from_public_bytes(raw))


def new_key() -> str:
    """A fresh signing key as base64 of its 32 raw bytes (`sweeper local`: one per run)."""
    return base64.b64encode(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
        serialization.NoEncryption())).decode()


def local_key(data_dir: Path) -> Ed25519PrivateKey:
    """The local (embedded-database) signing key under `data_dir`, created on first use
    (readable by its owner only)."""
    path = data_dir / LOCAL_KEY_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: use theirs
            pass
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
    return private_key(path.read_bytes())
