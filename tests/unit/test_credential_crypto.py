"""Credentials at rest: sealing bound to the row, key rotation, fingerprints, the key
settings, and which secrets may be stored (exactly the header values httpx sends)."""

from __future__ import annotations

import base64
import hashlib
import os

import h11
import httpx
import pytest
from pydantic import ValidationError

from service.config.settings import Settings, load_settings
from service.credentials.crypto import CredentialUnreadable, Keyring, Sealed, key_id
from service.credentials.source import MAX_SECRET_CHARS, secret_problem
from service.errors import ConfigError

KEY_A = bytes(range(32))
KEY_B = bytes(range(32, 64))
SECRET = "tok-" + "s3cr3t" * 4


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SWEEPER_"):
            monkeypatch.delenv(name)


def test_a_sealed_secret_opens_for_its_row_only() -> None:
    keyring = Keyring([KEY_A])
    sealed = keyring.seal(SECRET, "acme", "shop")
    assert keyring.open(sealed, "acme", "shop") == SECRET
    assert SECRET.encode() not in sealed.ciphertext
    for tenant, upstream in [("globex", "shop"), ("acme", "other"), ("acmes", "hop"),
                             ("acm", "eshop"), ("", "acmeshop")]:
        with pytest.raises(CredentialUnreadable, match="copied from another row") as caught:
            keyring.open(sealed, tenant, upstream)
        assert (caught.value.tenant_id, caught.value.upstream) == (tenant, upstream)
        assert SECRET not in str(caught.value)


def test_every_write_draws_a_new_nonce() -> None:
    keyring = Keyring([KEY_A])
    seals = [keyring.seal(SECRET, "acme", "shop") for _ in range(50)]
    assert len({s.nonce for s in seals}) == 50
    assert all(len(s.nonce) == 12 for s in seals)
    assert len({s.ciphertext for s in seals}) == 50


@pytest.mark.parametrize("damage", ["ciphertext", "nonce", "short-nonce"])
def test_an_altered_row_does_not_open(damage: str) -> None:
    keyring = Keyring([KEY_A])
    sealed = keyring.seal(SECRET, "acme", "shop")
    flipped = bytes([sealed.ciphertext[0] ^ 1]) + sealed.ciphertext[1:]
    altered = {"ciphertext": Sealed(sealed.key_id, sealed.nonce, flipped),
               "nonce": Sealed(sealed.key_id, bytes(12), sealed.ciphertext),
               "short-nonce": Sealed(sealed.key_id, b"", sealed.ciphertext)}[damage]
    with pytest.raises(CredentialUnreadable):
        keyring.open(altered, "acme", "shop")


def test_previous_keys_open_and_the_current_key_writes() -> None:
    old = Keyring([KEY_A]).seal(SECRET, "acme", "shop")
    rotated = Keyring([KEY_B, KEY_A])
    assert rotated.open(old, "acme", "shop") == SECRET
    assert rotated.seal(SECRET, "acme", "shop").key_id == key_id(KEY_B) == rotated.current_id
    assert rotated.key_ids == {key_id(KEY_A), key_id(KEY_B)}
    # once the old key is dropped, its rows name the key they need
    with pytest.raises(CredentialUnreadable, match=f"key {key_id(KEY_A)} is not configured"):
        Keyring([KEY_B]).open(old, "acme", "shop")


def test_a_key_id_is_the_start_of_the_keys_sha256() -> None:
    assert key_id(KEY_A) == hashlib.sha256(KEY_A).hexdigest()[:16]
    assert key_id(KEY_A) != key_id(KEY_B)


def test_fingerprints_compare_secrets_without_revealing_them() -> None:
    a, b = Keyring([KEY_A]), Keyring([KEY_B, KEY_A])
    fingerprint = a.fingerprint(SECRET)
    assert len(fingerprint) == 12 and set(fingerprint) <= set("0123456789abcdef")
    assert a.fingerprint(SECRET) == fingerprint
    assert a.fingerprint(SECRET + "x") != fingerprint
    assert b.fingerprint(SECRET) != fingerprint  # keyed by the current key
    # not a plain hash anyone could check guesses against
    for digest in (hashlib.sha256, hashlib.sha1, hashlib.md5):
        assert not digest(SECRET.encode()).hexdigest().startswith(fingerprint)


def test_no_repr_shows_a_key_or_a_secret() -> None:
    keyring = Keyring([KEY_A, KEY_B])
    sealed = keyring.seal(SECRET, "acme", "shop")
    shown = repr(keyring) + repr(sealed)
    for hidden in (KEY_A.hex(), repr(KEY_A), sealed.nonce.hex(), repr(sealed.ciphertext)):
        assert hidden not in shown
    assert key_id(KEY_A) in repr(keyring)


def test_a_keyring_needs_a_key() -> None:
    with pytest.raises(ValueError, match="at least the current key"):
        Keyring([])


# -- the key settings -------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    base64.b64encode(KEY_A).decode(), base64.urlsafe_b64encode(KEY_A).decode(),
    base64.urlsafe_b64encode(KEY_A).decode().rstrip("="),
    f"  {base64.b64encode(KEY_A).decode()}\n"])
def test_the_key_is_base64_in_either_alphabet(monkeypatch: pytest.MonkeyPatch,
                                              text: str) -> None:
    monkeypatch.setenv("SWEEPER_CREDENTIALS_KEY", text)
    settings = load_settings()
    assert settings.credential_keys() == [KEY_A]
    keyring = Keyring.from_settings(settings)
    assert keyring is not None and keyring.current_id == key_id(KEY_A)
    assert text.strip() not in repr(settings)


def test_no_key_means_no_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_CREDENTIALS_KEY", "")
    settings = load_settings()
    assert settings.credential_keys() == [] and Keyring.from_settings(settings) is None


@pytest.mark.parametrize("text", [
    base64.b64encode(KEY_A[:16]).decode(),        # AES-128 is not the key asked for
    base64.b64encode(KEY_A + b"x").decode(),
    "not base64 at all!" * 3, KEY_A.hex(), "é" * 44])
def test_a_bad_key_is_named_and_never_quoted(monkeypatch: pytest.MonkeyPatch,
                                             text: str) -> None:
    monkeypatch.setenv("SWEEPER_CREDENTIALS_KEY", text)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    (problem,) = caught.value.problems
    assert problem.startswith("SWEEPER_CREDENTIALS_KEY: must be 32 random bytes in base64")
    assert text not in problem
    # nor does pydantic's own error, should Settings be built directly
    with pytest.raises(ValidationError) as refused:
        Settings(credentials_key=text)
    assert text not in str(refused.value)


def test_previous_keys_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_CREDENTIALS_KEY", base64.b64encode(KEY_B).decode())
    monkeypatch.setenv("SWEEPER_CREDENTIALS_PREVIOUS_KEYS",
                       f" {base64.b64encode(KEY_A).decode()} ,")
    keyring = Keyring.from_settings(load_settings())
    assert keyring is not None
    assert keyring.open(Keyring([KEY_A]).seal(SECRET, "t", "u"), "t", "u") == SECRET

    bad = "short"
    monkeypatch.setenv("SWEEPER_CREDENTIALS_PREVIOUS_KEYS",
                       f"{base64.b64encode(KEY_A).decode()},{bad}")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert caught.value.problems == (
        "SWEEPER_CREDENTIALS_PREVIOUS_KEYS: key 2 of 2: must be 32 random bytes in base64 "
        "(standard or URL-safe), such as `openssl rand -base64 32` prints",)


def test_previous_keys_need_a_current_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_CREDENTIALS_PREVIOUS_KEYS", base64.b64encode(KEY_A).decode())
    with pytest.raises(ConfigError, match="needs SWEEPER_CREDENTIALS_KEY"):
        load_settings()


# -- what a credential may be ------------------------------------------------------------

def httpx_sends(value: str) -> bool:
    """Whether httpx would send `value` as a header value over HTTP/1.1 (h11's check)."""
    try:
        request = httpx.Request("DELETE", "http://shop.example/x", headers={"X-Token": value})
        h11.Request(method="DELETE", target="/x",
                    headers=[(k, v) for k, v in request.headers.raw])
    except (UnicodeEncodeError, h11.LocalProtocolError):
        return False
    return True


CANDIDATES = ["shpat_0123", "Bearer abc.def-ghi", "a", "~!#$%&'()*+,-./:;<=>?@[\\]^_`{|}",
              "a b", "a  b", "x" * MAX_SECRET_CHARS,
              # refused
              "", " a", "a ", "a\tb", "a\nb", "a\r\nb", "a\x00b", "a\x7fb", "a\x1bb",
              "naïve", "a\u2028b", "\ud800", "x" * (MAX_SECRET_CHARS + 1), "\t", " "]


@pytest.mark.parametrize("value", CANDIDATES, ids=lambda v: repr(v)[:20])
def test_what_is_stored_is_what_httpx_sends(value: str) -> None:
    # every credential accepted is a header value httpx sends as is; whatever httpx would
    # refuse is refused when stored (stricter: no tab, no control character it tolerates)
    if secret_problem(value) is None:
        assert httpx_sends(value)
    if len(value) <= MAX_SECRET_CHARS and not httpx_sends(value):
        assert secret_problem(value) is not None


def test_every_single_character_by_the_rule() -> None:
    for code in range(0x100):
        value = f"a{chr(code)}b"
        assert (secret_problem(value) is None) == (0x20 <= code <= 0x7e), hex(code)
        if secret_problem(value) is None:
            assert httpx_sends(value)
    assert secret_problem("x" * (MAX_SECRET_CHARS + 1)) == "must be at most 8192 characters"
