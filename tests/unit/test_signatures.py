"""Signature schemes as pure functions: a published Standard Webhooks vector, the reference
library as an independent signer, Shopify and hex HMACs computed here, and every way a
delivery can fail to be authentic."""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime

import pytest
from standardwebhooks import Webhook

from service.protocols import webhook_signatures
from service.protocols.webhook_signatures import SignatureRejected, keys_for, verify

# The vector the Standard Webhooks libraries test against (secret without prefix).
VECTOR_SECRET = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

SECRET = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"an older key that still counts").decode()
NOW = 1_800_000_000


def std_headers(body: bytes, secret: str = SECRET, ts: int = NOW, msg_id: str = "msg_1"
                ) -> dict[str, str]:
    sig = Webhook(secret).sign(msg_id, datetime.fromtimestamp(ts, tz=UTC), body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}


def check_std(headers: dict[str, str], body: bytes, secrets: tuple[str, ...] = (SECRET,),
              now: float = NOW) -> webhook_signatures.Verified:
    return verify("standard", keys_for("standard", secrets), headers, body, now_s=now,
                  tolerance_s=300)


def test_published_vector() -> None:
    headers = {"webhook-id": VECTOR_ID, "webhook-timestamp": str(VECTOR_TS),
               "webhook-signature": VECTOR_SIG}
    got = check_std(headers, VECTOR_BODY, (VECTOR_SECRET,), now=VECTOR_TS + 10)
    assert got.timestamp == VECTOR_TS
    with pytest.raises(SignatureRejected):
        check_std(headers, VECTOR_BODY + b" ", (VECTOR_SECRET,), now=VECTOR_TS)


def test_reference_library_signatures_verify() -> None:
    body = '{"type": "order.cancelled", "data": {"id": "ü-1"}}'.encode()
    assert check_std(std_headers(body), body).timestamp == NOW


def test_several_signatures_and_secrets() -> None:
    body = b'{"type": "x"}'
    old = std_headers(body, OLD_SECRET)["webhook-signature"]
    new = std_headers(body, SECRET)["webhook-signature"]
    headers = std_headers(body)
    headers["webhook-signature"] = f"v2,abc v1,!!! {old} {new}"
    check_std(headers, body)  # one good signature among junk
    headers["webhook-signature"] = old
    check_std(headers, body, (SECRET, OLD_SECRET))  # rotation: the old secret still counts
    with pytest.raises(SignatureRejected):
        check_std(headers, body, (SECRET,))


@pytest.mark.parametrize(("change", "reason"), [
    ({"webhook-timestamp": str(NOW - 301)}, "timestamp"),
    ({"webhook-timestamp": str(NOW + 301)}, "timestamp"),
    ({"webhook-timestamp": "1.8e9"}, "timestamp"),
    ({"webhook-timestamp": "٣"}, "timestamp"),
    ({"webhook-timestamp": ""}, "signature"),
    ({"webhook-id": "msg_2"}, "signature"),
    ({"webhook-id": ""}, "signature"),
    ({"webhook-signature": ""}, "signature"),
    ({"webhook-signature": "v1,"}, "signature"),
    ({"webhook-signature": "v1a,AAAA"}, "signature"),
])
def test_standard_refusals(change: dict[str, str], reason: str) -> None:
    body = b'{"type": "x"}'
    headers = {**std_headers(body), **change}
    with pytest.raises(SignatureRejected) as info:
        check_std(headers, body)
    assert info.value.reason == reason


def test_standard_tolerance_edges_and_timestamp_is_signed() -> None:
    body = b"{}"
    check_std(std_headers(body, ts=NOW - 300), body)
    check_std(std_headers(body, ts=NOW + 300), body)
    headers = std_headers(body, ts=NOW - 10)
    headers["webhook-timestamp"] = str(NOW)  # moving the timestamp breaks the signature
    with pytest.raises(SignatureRejected):
        check_std(headers, body)


def test_standard_truncated_body_and_wrong_secret() -> None:
    body = b'{"type": "order.cancelled", "data": {"id": 1}}'
    headers = std_headers(body)
    with pytest.raises(SignatureRejected):
        check_std(headers, body[:-1])
    with pytest.raises(SignatureRejected):
        check_std(headers, body, (OLD_SECRET,))


def test_standard_secret_decoding() -> None:
    raw = b"0123456789abcdef0123456789abcdef"
    unpadded = base64.b64encode(raw).decode().rstrip("=")
    assert webhook_signatures.standard_key("whsec_" + unpadded) == raw
    assert webhook_signatures.standard_key(base64.b64encode(raw).decode()) == raw
    for bad in ("whsec_", "whsec_@@@@", "whsec_abcde"):
        with pytest.raises(ValueError, match=r"base64|empty"):
            webhook_signatures.standard_key(bad)


def shopify_hmac(secret: str, body: bytes) -> str:
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


def test_shopify() -> None:
    body = b'{"id": 820982911946154508}'
    keys = keys_for("shopify", ("shpss_new", "shpss_old"))
    for secret in ("shpss_new", "shpss_old"):
        headers = {"x-shopify-hmac-sha256": shopify_hmac(secret, body)}
        assert verify("shopify", keys, headers, body, now_s=NOW, tolerance_s=300
                      ).timestamp is None
    for headers, sent in (({"x-shopify-hmac-sha256": shopify_hmac("other", body)}, body),
                          ({"x-shopify-hmac-sha256": shopify_hmac("shpss_new", body)},
                           body[:-1]),
                          ({"x-shopify-hmac-sha256": "not base64!"}, body),
                          ({}, body)):
        with pytest.raises(SignatureRejected):
            verify("shopify", keys, headers, sent, now_s=NOW, tolerance_s=300)


def test_hex_hmac() -> None:
    body = b'{"type": "cart.expired"}'
    digest = hmac.new(b"plain-secret", body, hashlib.sha256).hexdigest()
    keys = keys_for("hmac-sha256", ("plain-secret",))
    for value in (digest, digest.upper(), "sha256=" + digest):
        verify("hmac-sha256", keys, {"x-sig": value}, body, now_s=NOW, tolerance_s=1,
               signature_header="X-Sig")
    for value in (digest[:-2], "zz" + digest[2:], ""):
        with pytest.raises(SignatureRejected):
            verify("hmac-sha256", keys, {"x-sig": value}, body, now_s=NOW, tolerance_s=1,
                   signature_header="X-Sig")


def test_no_keys_accepts_nothing() -> None:
    with pytest.raises(SignatureRejected):
        verify("shopify", (), {"x-shopify-hmac-sha256": "AAAA"}, b"", now_s=NOW,
               tolerance_s=1)


def test_a_static_header_secret() -> None:
    keys = keys_for("header", ("first-static-secret-16", "second-static-secret"))
    for value in ("first-static-secret-16", "second-static-secret"):
        verify("header", keys, {"x-secret": value}, b"{}", now_s=NOW, tolerance_s=1,
               signature_header="X-Secret")
    for headers in ({}, {"x-secret": ""}, {"x-secret": "first-static-secret-1"},
                    {"x-secret": "first-static-secret-16 "}, {"x-other": "second-static-secret"},
                    {"x-secret": "FIRST-STATIC-SECRET-16"}):
        with pytest.raises(SignatureRejected):
            verify("header", keys, headers, b"{}", now_s=NOW, tolerance_s=1,
                   signature_header="X-Secret")
    with pytest.raises(SignatureRejected):  # a source without its header verifies nothing
        verify("header", keys, {"x-secret": "second-static-secret"}, b"{}", now_s=NOW,
               tolerance_s=1)
