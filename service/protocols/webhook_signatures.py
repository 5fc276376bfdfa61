"""Webhook signature schemes: pure functions over the raw body and the request headers.

Every check runs on the bytes as received, before anything is parsed. Several secrets may be
valid at once (rotation): every secret is tried against every presented signature with
`hmac.compare_digest`, without stopping at the first match, so timing says nothing about
which secret or which signature matched.

    verify(scheme, keys, headers, body, now_s, tolerance_s, signature_header) -> Verified
        raises SignatureRejected(reason)   reason: "signature" | "timestamp"

The `header` scheme is the exception: a static secret in a header, compared in constant
time, which authenticates the sender only as far as the secret stays unseen.

The reason is for metrics and logs only; the HTTP answer never says which part failed.
`headers` is a case-insensitive mapping (Starlette's `Headers`) or a dict with lower-case
keys; values are str decoded as latin-1, so `.encode("latin-1")` gives the wire bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

STANDARD_SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - a prefix, not a secret
MAX_SIGNATURES: Final = 32  # per header; more are ignored (bounds the work per delivery)
MAX_TIMESTAMP_DIGITS: Final = 12  # seconds since 1970 fit in 11 digits until year 5138

Scheme = Literal["standard", "shopify", "hmac-sha256", "header"]
RejectReason = Literal["signature", "timestamp"]


class SignatureRejected(Exception):
    """The delivery is not authentic (or too old/new to tell): answer 401, write nothing."""

    def __init__(self, reason: RejectReason) -> None:
        super().__init__(reason)
        self.reason: RejectReason = reason


@dataclass(frozen=True)
class Verified:
    """What a valid signature vouches for. `timestamp` (Unix seconds) is signed only in the
    standard scheme; None elsewhere."""

    timestamp: int | None


def standard_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: base64 after an optional `whsec_` prefix
    (padding optional, as the reference library accepts). ValueError when not base64."""
    raw = secret.removeprefix(STANDARD_SECRET_PREFIX).rstrip("=")
    if len(raw) % 4 == 1:
        raise ValueError("not base64")
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
    if not key:
        raise ValueError("empty")
    return key


def keys_for(scheme: Scheme, secrets: Sequence[str]) -> tuple[bytes, ...]:
    """HMAC keys from configured secrets: decoded for `standard`, UTF-8 bytes otherwise."""
    if scheme == "standard":
        return tuple(standard_key(s) for s in secrets)
    return tuple(s.encode("utf-8") for s in secrets)


def _any_match(keys: Sequence[bytes], message: bytes, presented: Sequence[bytes]) -> bool:
    matched = False
    for key in keys:
        expected = hmac.new(key, message, hashlib.sha256).digest()
        for candidate in presented:
            # no short cut: every pair is compared whatever matched before
            matched |= hmac.compare_digest(expected, candidate)
    return matched


def _b64(value: str) -> bytes | None:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None


def verify_standard(keys: Sequence[bytes], headers: Mapping[str, str], body: bytes,
                    now_s: float, tolerance_s: float) -> Verified:
    """Standard Webhooks: `webhook-signature` holds space-separated `v1,<base64>` HMAC-SHA256
    signatures of `{webhook-id}.{webhook-timestamp}.{body}`; the timestamp must be within
    `tolerance_s` of now, either way."""
    msg_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    header = headers.get("webhook-signature")
    if not (msg_id and stamp and header):
        raise SignatureRejected("signature")
    if not stamp.isascii() or not stamp.isdigit() or len(stamp) > MAX_TIMESTAMP_DIGITS:
        raise SignatureRejected("timestamp")
    timestamp = int(stamp)
    if abs(now_s - timestamp) > tolerance_s:
        raise SignatureRejected("timestamp")
    presented = []
    for part in header.split(" ")[:MAX_SIGNATURES]:
        version, _, value = part.partition(",")
        if version == "v1" and (sig := _b64(value)) is not None:
            presented.append(sig)
    message = msg_id.encode("latin-1") + b"." + stamp.encode("ascii") + b"." + body
    if not _any_match(keys, message, presented):
        raise SignatureRejected("signature")
    return Verified(timestamp=timestamp)


def verify_shopify(keys: Sequence[bytes], headers: Mapping[str, str], body: bytes) -> Verified:
    """Shopify: `X-Shopify-Hmac-Sha256` is the base64 HMAC-SHA256 of the raw body."""
    sig = _b64(headers.get("x-shopify-hmac-sha256") or "")
    if not sig or not _any_match(keys, body, [sig]):
        raise SignatureRejected("signature")
    return Verified(timestamp=None)


def verify_hex(keys: Sequence[bytes], headers: Mapping[str, str], body: bytes,
               signature_header: str) -> Verified:
    """Plain HMAC-SHA256 of the raw body, hex-encoded in `signature_header` (an optional
    `sha256=` prefix, as GitHub-style senders write it, is accepted)."""
    value = (headers.get(signature_header.lower()) or "").strip().removeprefix("sha256=")
    try:
        sig = bytes.fromhex(value)
    except ValueError:
        raise SignatureRejected("signature") from None
    if not sig or not _any_match(keys, body, [sig]):
        raise SignatureRejected("signature")
    return Verified(timestamp=None)


def verify_header(keys: Sequence[bytes], headers: Mapping[str, str],
                  signature_header: str) -> Verified:
    """A static secret in `signature_header` (BigCommerce's custom headers): it signs
    nothing, so whoever sees one delivery can send others. Digests are compared, so the
    time taken says nothing of the secret's length either."""
    value = headers.get(signature_header.lower())
    if not value:
        raise SignatureRejected("signature")
    presented = hashlib.sha256(value.encode("latin-1")).digest()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(hashlib.sha256(key).digest(), presented)
    if not matched:
        raise SignatureRejected("signature")
    return Verified(timestamp=None)


def verify(scheme: Scheme, keys: Sequence[bytes], headers: Mapping[str, str], body: bytes, *,
           now_s: float, tolerance_s: float, signature_header: str | None = None) -> Verified:
    """Verify a delivery under its source's scheme; SignatureRejected when not authentic."""
    if not keys:
        raise SignatureRejected("signature")
    if scheme == "standard":
        return verify_standard(keys, headers, body, now_s, tolerance_s)
    if scheme == "shopify":
        return verify_shopify(keys, headers, body)
    if signature_header is None:
        raise SignatureRejected("signature")
    if scheme == "header":
        return verify_header(keys, headers, signature_header)
    return verify_hex(keys, headers, body, signature_header)
