"""The evidence export's hash chain and signed manifest: every kind of edit fails at the
first line it breaks, and only a published key's signature verifies."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from service import evidence
from service.evidence import Chain, PublicKey, Signer, VerificationFailed, verify

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
SIGNER = Signer(KEY)
PUBLISHED = [PublicKey(KEY.public_key())]
AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def export(n: int = 5, run_id: int = 7, signer: Signer | None = SIGNER) -> list[bytes]:
    chain = Chain(run_id, signer)
    lines = [chain.line({"item_id": i, "tenant_id": "acme", "object_id": f"cart-{i}",
                         "policy": "carts", "policy_version": 1, "outcome": "succeeded",
                         "upstream_status": 204, "completed_at": AT}) for i in range(1, n + 1)]
    return [*lines, chain.manifest(AT)]


def failure(lines: list[bytes], keys: list[PublicKey] = PUBLISHED) -> VerificationFailed:
    with pytest.raises(VerificationFailed) as caught:
        verify([line + b"\n" for line in lines], keys)
    return caught.value


def test_an_untouched_export_verifies() -> None:
    assert verify([line + b"\n" for line in export()], PUBLISHED) == evidence.Verified(
        run_id=7, records=5, key_id=SIGNER.current.key_id)
    assert verify(export(0), PUBLISHED).records == 0  # an empty run: the manifest alone


def test_a_changed_line_fails_where_the_chain_breaks() -> None:
    lines = export()
    lines[2] = lines[2].replace(b"cart-3", b"cart-9")
    assert failure(lines).line == 4
    last = export()
    last[4] = last[4].replace(b"204", b"200")  # the last record: the manifest breaks
    assert failure(last).line == 6


@pytest.mark.parametrize("edit", ["dropped", "reordered", "inserted", "duplicated"])
def test_dropped_reordered_and_inserted_lines_fail(edit: str) -> None:
    lines = export()
    if edit == "dropped":
        del lines[1]
        expected = 2
    elif edit == "reordered":
        lines[1], lines[2] = lines[2], lines[1]
        expected = 2
    elif edit == "inserted":
        lines.insert(3, export(run_id=7)[0])  # a well-formed line of the same run
        expected = 4
    else:
        lines.insert(1, lines[0])
        expected = 2
    assert failure(lines).line == expected


def test_the_tail_and_the_manifest_are_covered() -> None:
    lines = export()
    assert failure(lines[:-1]).reason.startswith("missing")  # no manifest
    assert failure([*lines[:3], lines[-1]]).line == 4  # records dropped at the end
    assert failure([*lines, lines[0]]).line == 7  # a line after the manifest
    doc = json.loads(lines[-1])
    doc["manifest"]["records"] = 5
    doc["manifest"]["exported_at"] = "2030-01-01T00:00:00+00:00"  # re-dated
    assert "signature" in failure([*lines[:-1], json.dumps(doc).encode()]).reason
    other_run = export(run_id=8)
    assert failure([*lines[:-1], other_run[-1]]).line == 6


def test_only_a_published_key_verifies() -> None:
    forged = export(signer=Signer(OTHER))
    assert "not among the public keys" in failure(forged).reason
    # the forger names the real key id but cannot make its signature
    doc = json.loads(forged[-1])
    doc["manifest"]["key_id"] = SIGNER.current.key_id
    assert "does not verify" in failure([*forged[:-1], json.dumps(doc).encode()]).reason
    assert "not signed" in failure(export(signer=None)).reason
    # rotation: an export signed before it still verifies with the earlier key published
    rotated = Signer(OTHER, previous=(PublicKey(KEY.public_key()),))
    assert [k.key_id for k in rotated.published] == [
        PublicKey(OTHER.public_key()).key_id, SIGNER.current.key_id]
    assert verify(export(), rotated.published).key_id == SIGNER.current.key_id


def test_keys_load_from_pem_base64_and_the_public_key_document() -> None:
    pem = KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = base64.b64encode(bytes(range(32)))
    assert evidence.key_id(evidence.private_key(pem).public_key()) == SIGNER.current.key_id
    assert evidence.key_id(evidence.private_key(raw).public_key()) == SIGNER.current.key_id
    document = json.dumps({"keys": [{"key_id": k.key_id, "public_key": k.base64}
                                    for k in Signer(OTHER, (PUBLISHED[0],)).published]})
    assert len(evidence.public_keys(document.encode())) == 2
    assert [k.key_id for k in evidence.public_keys(PUBLISHED[0].pem.encode())] == [
        SIGNER.current.key_id]
    assert [k.key_id for k in evidence.public_keys(PUBLISHED[0].base64.encode())] == [
        SIGNER.current.key_id]
    for bad in (b"", b"not a key", b"-----BEGIN PRIVATE KEY-----\nxx\n-----END PRIVATE KEY-----"):
        with pytest.raises(evidence.KeyProblem) as caught:
            evidence.private_key(bad)
        assert "xx" not in str(caught.value)
    with pytest.raises(evidence.KeyProblem):
        evidence.public_keys(b'{"keys": [{"public_key": "short"}]}')


def test_the_local_key_is_made_once_and_kept_private(tmp_path: object) -> None:
    from pathlib import Path
    data_dir = Path(str(tmp_path)) / "data"
    first = evidence.local_key(data_dir)
    again = evidence.local_key(data_dir)
    assert evidence.key_id(first.public_key()) == evidence.key_id(again.public_key())
    assert (data_dir / evidence.LOCAL_KEY_FILE).stat().st_mode & 0o077 == 0
