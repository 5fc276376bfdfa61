"""Credentials at rest: AES-256-GCM under the current key, opened under any key still
configured (rotation), bound to their row.

Each write draws a fresh 96-bit nonce (random nonces stay safe for far more writes than a
credential table sees: NIST SP 800-38D allows 2^32 per key). The associated data is the
row's identity, `(tenant_id, upstream)`, so a ciphertext copied to another row does not
open there: a database user who can write rows but holds no key cannot hand one tenant's
token to another. Each row names its key by `key_id`, the first 8 bytes of the key's
SHA-256 in hex (`base64 -d <<< "$KEY" | sha256sum | cut -c1-16`), which says which key
opens it and reveals nothing of the key.

The fingerprint operators compare is an HMAC-SHA256 of the secret under a key derived from
the encryption key (12 hex digits): without the key it cannot be checked against guesses,
unlike a plain hash of a short token. It changes when the key does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service.config.settings import Settings
from service.errors import SweeperError

NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
FINGERPRINT_HEX: Final = 12
KEY_ID_HEX: Final = 16
# Versioned labels: a change of format never opens old rows by accident.
_AAD_LABEL: Final = b"sweeper/tenant-credential/v1"
_FINGERPRINT_LABEL: Final = b"sweeper/credential-fingerprint/v1"


class CredentialUnreadable(SweeperError):
    """A stored credential that no configured key opens for its row: its key is no longer
    configured, or the row was altered or copied from another row. Names the row, never
    any part of the secret or the key."""

    def __init__(self, tenant_id: str, upstream: str, key_id: str, reason: str) -> None:
        super().__init__(f"the credential of upstream {upstream!r} for this tenant cannot be "
                         f"opened: {reason}")
        self.tenant_id = tenant_id
        self.upstream = upstream
        self.key_id = key_id
        self.reason = reason


@dataclass(frozen=True)
class Sealed:
    """A credential as stored: which key, the nonce, and ciphertext with its tag."""

    key_id: str
    nonce: bytes = field(repr=False)
    ciphertext: bytes = field(repr=False)


def key_id(key: bytes) -> str:
    """The short public name of a key."""
    return hashlib.sha256(key).hexdigest()[:KEY_ID_HEX]


def _aad(tenant_id: str, upstream: str) -> bytes:
    # length-prefixed, so no two (tenant, upstream) pairs share associated data
    parts = [_AAD_LABEL, tenant_id.encode("utf-8"), upstream.encode("utf-8")]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


@dataclass(frozen=True)
class _Key:
    id: str
    aead: AESGCM = field(repr=False)
    fingerprint_key: bytes = field(repr=False)

    @classmethod
    def of(cls, material: bytes) -> _Key:
        # a key of its own for fingerprints: one key is never used by two algorithms
        derived = hmac.new(material, _FINGERPRINT_LABEL, hashlib.sha256).digest()
        return cls(key_id(material), AESGCM(material), derived)


class Keyring:
    """The current key, which every write uses, and earlier ones that still open rows."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a keyring needs at least the current key")
        built = [_Key.of(k) for k in keys]
        self._current = built[0]
        self._by_id = {k.id: k for k in reversed(built)}  # the current key wins a clash

    @classmethod
    def from_settings(cls, settings: Settings) -> Keyring | None:
        """SWEEPER_CREDENTIALS_KEY then SWEEPER_CREDENTIALS_PREVIOUS_KEYS; None when no key
        is configured (credential storage is off)."""
        keys = settings.credential_keys()
        return cls(keys) if keys else None

    def __repr__(self) -> str:
        return f"Keyring(current={self._current.id!r}, keys={len(self._by_id)})"

    @property
    def current_id(self) -> str:
        """The key id every write records."""
        return self._current.id

    @property
    def key_ids(self) -> frozenset[str]:
        """Every key id this keyring opens."""
        return frozenset(self._by_id)

    def seal(self, secret: str, tenant_id: str, upstream: str) -> Sealed:
        """Encrypt `secret` for exactly this row under the current key."""
        nonce = os.urandom(NONCE_BYTES)
        ciphertext = self._current.aead.encrypt(nonce, secret.encode("utf-8"),
                                                _aad(tenant_id, upstream))
        return Sealed(self._current.id, nonce, ciphertext)

    def open(self, sealed: Sealed, tenant_id: str, upstream: str) -> str:
        """The secret of this row; CredentialUnreadable if no configured key opens it."""
        key = self._by_id.get(sealed.key_id)
        if key is None:
            raise CredentialUnreadable(tenant_id, upstream, sealed.key_id,
                                       f"key {sealed.key_id} is not configured")
        try:
            plain = key.aead.decrypt(sealed.nonce, sealed.ciphertext, _aad(tenant_id, upstream))
        except (InvalidTag, ValueError):  # ValueError: a nonce of the wrong size
            raise CredentialUnreadable(
                tenant_id, upstream, sealed.key_id,
                "it does not authenticate for this tenant and upstream (altered, or copied "
                "from another row)") from None
        return plain.decode("utf-8")

    def fingerprint(self, secret: str) -> str:
        """A short identifier of `secret` under the current key; not reversible, and not
        checkable against guesses without the key."""
        digest = hmac.new(self._current.fingerprint_key, secret.encode("utf-8"),
                          hashlib.sha256).hexdigest()
        return digest[:FINGERPRINT_HEX]
