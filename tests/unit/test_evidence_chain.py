"""Evidence exports as slices of the log: the canonical record, the chain, checkpoints and
the manifest; every kind of edit of an export fails at the first line it breaks, and only a
published key's signature verifies. (The same chain written by PostgreSQL and tampered
with there: tests/integration/test_evidence_log.py.)"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from service import evidence, evidence_log
from service.evidence import PublicKey, Signer, VerificationFailed
from service.evidence_log import GENESIS, GENESIS_CHECKPOINT, Checkpoint, signed_bytes
from service.evidence_slices import Slices, kept_checkpoints, verify

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
SIGNER = Signer(KEY)
PUBLISHED = [PublicKey(KEY.public_key())]
AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def entries(n: int) -> list[dict[str, Any]]:
    """A log of n entries: odd items released by run 7, even ones by webhook hints."""
    rows, head = [], GENESIS
    for seq in range(1, n + 1):
        record = {"item_id": seq, "run_id": 7 if seq % 2 else None,
                  "released_by": "run" if seq % 2 else "webhook", "tenant_id": "acme",
                  "object_id": f"cart-{seq}", "policy": "carts", "policy_version": 1,
                  "operation_key": "k" * 64, "outcome": "succeeded", "upstream_status": 204,
                  "attempts": 1, "completed_at": AT}
        head = evidence_log.chain(head, evidence_log.leaf(record))
        rows.append({**record, "seq": seq, "hash": head})
    return rows


def checkpoint(rows: list[dict[str, Any]], size: int, signer: Signer | None = SIGNER
               ) -> Checkpoint:
    unsigned = Checkpoint(size, rows[size - 1]["hash"], AT,
                          signer.current.key_id if signer else None, None)
    signature = signer.sign(signed_bytes(unsigned.statement())) if signer else None
    return Checkpoint(size, unsigned.head, AT, unsigned.key_id, signature)


def export(n: int = 6, at: tuple[int, ...] = (3, 6), run_id: int | None = None,
           signer: Signer | None = SIGNER) -> list[bytes]:
    """Entries 1..n from genesis with checkpoints at `at`, then the manifest."""
    rows = entries(n)
    slices = Slices(signer, run_id=run_id)
    out = [slices.checkpoint(GENESIS_CHECKPOINT)]
    for row in rows:
        out.append(slices.entry(row))
        if row["seq"] in at:
            out.append(slices.checkpoint(checkpoint(rows, row["seq"], signer)))
    out.append(slices.manifest(next_after=None, exported_at=AT))
    return [line.rstrip(b"\n") for line in out]


def failure(lines: list[bytes], keys: list[PublicKey] = PUBLISHED,
            kept: dict[int, bytes] | None = None) -> VerificationFailed:
    with pytest.raises(VerificationFailed) as caught:
        verify([line + b"\n" for line in lines], keys, kept)
    return caught.value


def test_the_canonical_record_is_pinned() -> None:
    # the database builds these bytes too (evidence_log.leaf_sql): a change is a new format
    record = entries(1)[0]
    assert evidence_log.canonical(record) == (
        b"sweeper-evidence-log/1\n1\n7\n3:run\n4:acme\n6:cart-1\n5:carts\n1\n"
        b"64:" + b"k" * 64 + b"\n9:succeeded\n204\n1\n1796126400000000")
    assert evidence_log.canonical({**record, "run_id": None, "tenant_id": "\u00e9"}).split(
        b"\n")[2:5] == [b"", b"3:run", "2:\u00e9".encode()]
    for bad in ({**record, "attempts": True}, {**record, "completed_at": "yesterday"},
                {k: v for k, v in record.items() if k != "policy"}):
        with pytest.raises(evidence_log.RecordProblem):
            evidence_log.canonical(bad)


def test_an_untouched_export_verifies() -> None:
    verified = verify([line + b"\n" for line in export()], PUBLISHED)
    assert (verified.records, verified.entries, verified.checkpoints,
            verified.first_seq, verified.last_seq) == (6, 6, 3, 1, 6)
    # a run's export: the other entries as their leaf only, the same chain
    run = export(run_id=7)
    assert b"cart-2" not in b"".join(run)
    assert verify([line + b"\n" for line in run], PUBLISHED).records == 3
    assert verify([line + b"\n" for line in export(0, ())], PUBLISHED).records == 0


def test_a_changed_entry_fails_where_the_chain_breaks() -> None:
    lines = export()
    lines[2] = lines[2].replace(b"cart-2", b"cart-9")
    assert failure(lines).line == 3
    rehashed = export()  # the line's own hash recomputed: the checkpoint after it fails
    row = json.loads(rehashed[2])
    row["object_id"] = "cart-9"
    row["hash"] = evidence_log.chain(entries(1)[0]["hash"], evidence_log.leaf(
        {**row, "completed_at": AT})).hex()
    rehashed[2] = json.dumps(row).encode()
    assert failure(rehashed).line == 4


@pytest.mark.parametrize("edit", ["dropped", "reordered", "inserted", "duplicated"])
def test_dropped_reordered_and_inserted_lines_fail(edit: str) -> None:
    lines = export()
    if edit == "dropped":
        del lines[2]
    elif edit == "reordered":
        lines[2], lines[3] = lines[3], lines[2]
    elif edit == "inserted":
        lines.insert(2, export(run_id=7)[3])  # a well-formed line of another export
    else:
        lines.insert(2, lines[1])
    assert failure(lines).line == 3


def test_the_tail_the_checkpoints_and_the_manifest_are_covered() -> None:
    lines = export()
    assert failure(lines[:-1]).reason.startswith("missing")  # no manifest
    assert "no signature covers them" in failure([*lines[:-2], lines[-1]]).reason
    assert failure([*lines, lines[0]]).line == len(lines) + 1  # a line after the manifest
    doc = json.loads(lines[-1])
    doc["manifest"]["exported_at"] = "2030-01-01T00:00:00+00:00"  # re-dated
    assert "signature" in failure([*lines[:-1], json.dumps(doc).encode()]).reason
    assert "digest" in failure([*lines[:-1], export(6, (2, 6))[-1]]).reason
    # a record swapped for its leaf-only form chains the same: the manifest's count fails
    assert "the manifest counts 6 records" in failure(
        [*lines[:2], export(run_id=7)[2], *lines[3:]]).reason
    # a checkpoint re-stated over another head fails its signature
    doc = json.loads(lines[4])
    doc["checkpoint"]["head"] = "0" * 64
    assert "signature does not verify" in failure(
        [*lines[:4], json.dumps(doc).encode(), *lines[5:]]).reason
    # checkpoints the operator kept: the export must agree at their sizes
    kept = {3: bytes(32)}
    assert "differs from the checkpoint kept" in failure(lines, kept=kept).reason


def test_only_a_published_key_verifies() -> None:
    forged = export(signer=Signer(OTHER))
    assert "not among the public keys" in failure(forged).reason
    assert "not signed" in failure(export(signer=None)).reason
    # rotation: an export signed before it still verifies with the earlier key published
    rotated = Signer(OTHER, previous=(PublicKey(KEY.public_key()),))
    assert [k.key_id for k in rotated.published] == [
        PublicKey(OTHER.public_key()).key_id, SIGNER.current.key_id]
    assert verify([line + b"\n" for line in export()], rotated.published
                  ).key_id == SIGNER.current.key_id


def test_kept_checkpoints_are_read_and_checked() -> None:
    rows = entries(6)
    doc = {"checkpoints": [json.loads(checkpoint(rows, size).line()) for size in (3, 6)],
           "next_after": None}
    assert kept_checkpoints(json.dumps(doc).encode(), PUBLISHED) == {
        3: rows[2]["hash"], 6: rows[5]["hash"]}
    forged = {"checkpoints": [json.loads(checkpoint(rows, 3, Signer(OTHER)).line())]}
    with pytest.raises(VerificationFailed, match="not among the public keys"):
        kept_checkpoints(json.dumps(forged).encode(), PUBLISHED)
    with pytest.raises(VerificationFailed, match="neither"):
        kept_checkpoints(b"not json", PUBLISHED)


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
