"""Evidence exports as slices of the log: the canonical record, the segment chain,
checkpoints and the manifest; every kind of edit of an export fails at the first line it
breaks, and only a published key's signature verifies. (The same chain written by
PostgreSQL and tampered with there: tests/integration/test_evidence_log.py.)"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from service.config import signing_keys
from service.config.signing_keys import PublicKey, Signer
from service.evidence import deletion_records
from service.evidence.chain import GENESIS_CHECKPOINT, Checkpoint, Segment, signed_bytes
from service.evidence.deletion_records import GENESIS, leaf, segment_hash
from service.evidence.export_slices import Slices
from service.evidence.signed_exports import VerificationFailed
from service.evidence.verification import kept_checkpoints, verify

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
OTHER = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
SIGNER = Signer(KEY)
PUBLISHED = [PublicKey(KEY.public_key())]
AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
SPLIT = (2, 3, 6)  # segment ends: entries 1-2, 3, 4-6


def record(seq: int) -> dict[str, Any]:
    """Entry `seq`: odd ones released by run 7, even ones by webhook hints."""
    return {"item_id": seq, "run_id": 7 if seq % 2 else None,
            "released_by": "run" if seq % 2 else "webhook", "tenant_id": "acme",
            "object_id": f"cart-{seq}", "policy": "carts", "policy_version": 1,
            "operation_key": "k" * 64, "outcome": "succeeded", "upstream_status": 204,
            "attempts": 1, "completed_at": AT}


def segments(ends: tuple[int, ...] = SPLIT) -> list[Segment]:
    out, head, start = [], GENESIS, 1
    for end in ends:
        records = [record(seq) for seq in range(start, end + 1)]
        head = segment_hash(head, map(leaf, records))
        out.append(Segment(start, end, records, head))
        start = end + 1
    return out


def checkpoint(segment: Segment, signer: Signer | None = SIGNER) -> Checkpoint:
    unsigned = Checkpoint(segment.seq_end, segment.hash, AT,
                          signer.current.key_id if signer else None, None)
    signature = signer.sign(signed_bytes(unsigned.statement())) if signer else None
    return Checkpoint(unsigned.size, unsigned.head, AT, unsigned.key_id, signature)


def export(ends: tuple[int, ...] = SPLIT, at: tuple[int, ...] = (3, 6),
           run_id: int | None = None, signer: Signer | None = SIGNER) -> list[bytes]:
    """The segments from genesis with checkpoints after those ending at `at`, then the
    manifest: lines without their line breaks."""
    slices = Slices(signer, run_id=run_id)
    out = [slices.checkpoint(GENESIS_CHECKPOINT)]
    for segment in segments(ends):
        out.extend(slices.entry(segment.seq_start + n, r)
                   for n, r in enumerate(segment.records))
        out.append(slices.segment(segment))
        if segment.seq_end in at:
            out.append(slices.checkpoint(checkpoint(segment, signer)))
    out.append(slices.manifest(next_after=None, exported_at=AT))
    return [line.rstrip(b"\n") for line in out]


def failure(lines: list[bytes], keys: list[PublicKey] = PUBLISHED,
            kept: dict[int, bytes] | None = None) -> VerificationFailed:
    with pytest.raises(VerificationFailed) as caught:
        verify([line + b"\n" for line in lines], keys, kept)
    return caught.value


def test_the_canonical_record_is_pinned_and_read_back() -> None:
    # the database builds these bytes too (evidence_records.canonical_sql): a change is a
    # new format
    data = deletion_records.canonical(record(1))
    assert data == (b"sweeper-evidence-log/1\n1\n7\n3:run\n4:acme\n6:cart-1\n5:carts\n1\n"
                    b"64:" + b"k" * 64 + b"\n9:succeeded\n204\n1\n1796126400000000")
    assert deletion_records.parse(data) == record(1)
    odd = {**record(2), "tenant_id": "a:b\n12:c", "object_id": "\u00e9", "upstream_status": None}
    assert deletion_records.parse(deletion_records.canonical(odd)) == odd
    framed = b"".join(len(d).to_bytes(4, "big") + d for d in (data, data))
    assert deletion_records.frames(framed) == [data, data]
    for bad in ({**record(1), "attempts": True}, {**record(1), "completed_at": "yesterday"},
                {k: v for k, v in record(1).items() if k != "policy"}):
        with pytest.raises(deletion_records.RecordProblem):
            deletion_records.canonical(bad)
    for bad_bytes in (data[:-1] + b"x", data.replace(b"4:acme", b"5:acme"), b"other\n1"):
        with pytest.raises(deletion_records.RecordProblem):
            deletion_records.parse(bad_bytes)
    with pytest.raises(deletion_records.RecordProblem):
        deletion_records.frames(framed[:-1])


def test_an_untouched_export_verifies() -> None:
    verified = verify([line + b"\n" for line in export()], PUBLISHED)
    assert (verified.records, verified.entries, verified.checkpoints,
            verified.first_seq, verified.last_seq) == (6, 6, 3, 1, 6)
    # a run's export: the other entries as their leaf only, the same chain
    run = export(run_id=7)
    assert b"cart-2" not in b"".join(run)
    assert verify([line + b"\n" for line in run], PUBLISHED).records == 3
    assert verify([line + b"\n" for line in export((), ())], PUBLISHED).records == 0


def test_a_changed_entry_fails_at_its_segment_or_the_checkpoint_after_it() -> None:
    # lines: 1 genesis, 2-3 entries 1-2, 4 their segment, 5 entry 3, 6 its segment,
    # 7 the checkpoint at 3, ...
    lines = export()
    lines[2] = lines[2].replace(b"cart-2", b"cart-9")
    assert "do not hash to their segment's stored hash" in failure(lines).reason
    assert failure(lines).line == 4
    # the segment's hash recomputed too: the checkpoint after it fails
    rehashed = export()
    edited = {**record(2), "object_id": "cart-9"}
    rehashed[2] = json.dumps({"seq": 2, **edited}, default=str).encode()
    rehashed[3] = json.dumps({"segment": {"first": 1, "last": 2, "hash": segment_hash(
        GENESIS, [leaf(record(1)), leaf(edited)]).hex()}}).encode()
    rehashed[5] = json.dumps({"segment": {"first": 3, "last": 3, "hash": segment_hash(
        bytes.fromhex(json.loads(rehashed[3])["segment"]["hash"]), [leaf(record(3))]
    ).hex()}}).encode()
    assert failure(rehashed).line == 7
    assert "do not hash to this checkpoint's head (size 3)" in failure(rehashed).reason


@pytest.mark.parametrize("edit", ["dropped", "reordered", "inserted", "duplicated"])
def test_dropped_reordered_and_inserted_lines_fail(edit: str) -> None:
    lines = export()
    if edit == "dropped":
        del lines[2]
    elif edit == "reordered":
        lines[1], lines[2] = lines[2], lines[1]
    elif edit == "inserted":
        lines.insert(2, export(run_id=7)[4])  # a well-formed line of another export
    else:
        lines.insert(2, lines[1])
    assert failure(lines).line == (2 if edit == "reordered" else 3)


def test_the_tail_the_checkpoints_and_the_manifest_are_covered() -> None:
    lines = export()
    assert failure(lines[:-1]).reason.startswith("missing")  # no manifest
    assert "no signature covers them" in failure([*lines[:-2], lines[-1]]).reason
    assert failure([*lines, lines[0]]).line == len(lines) + 1  # a line after the manifest
    doc = json.loads(lines[-1])
    doc["manifest"]["exported_at"] = "2030-01-01T00:00:00+00:00"  # re-dated
    assert "signature" in failure([*lines[:-1], json.dumps(doc).encode()]).reason
    assert "digest" in failure([*lines[:-1], export(at=(2, 6))[-1]]).reason
    # a record swapped for its leaf-only form chains the same: the manifest's count fails
    assert "the manifest counts 6 records" in failure(
        [*lines[:2], export(run_id=7)[2], *lines[3:]]).reason
    # a checkpoint re-stated over another head fails its signature
    doc = json.loads(lines[6])
    doc["checkpoint"]["head"] = "0" * 64
    assert "signature does not verify" in failure(
        [*lines[:6], json.dumps(doc).encode(), *lines[7:]]).reason
    # checkpoints the operator kept: the export must agree at their sizes
    assert "differs from the checkpoint kept" in failure(lines, kept={2: bytes(32)}).reason


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
    found = segments()
    doc = {"checkpoints": [json.loads(checkpoint(s).line()) for s in found[1:]],
           "next_after": None}
    assert kept_checkpoints(json.dumps(doc).encode(), PUBLISHED) == {
        3: found[1].hash, 6: found[2].hash}
    forged = {"checkpoints": [json.loads(checkpoint(found[1], Signer(OTHER)).line())]}
    with pytest.raises(VerificationFailed, match="not among the public keys"):
        kept_checkpoints(json.dumps(forged).encode(), PUBLISHED)
    with pytest.raises(VerificationFailed, match="neither"):
        kept_checkpoints(b"not json", PUBLISHED)


def test_keys_load_from_pem_base64_and_the_public_key_document() -> None:
    pem = KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    raw = base64.b64encode(bytes(range(32)))
    assert signing_keys.key_id(signing_keys.private_key(pem).public_key()) == SIGNER.current.key_id
    assert signing_keys.key_id(signing_keys.private_key(raw).public_key()) == SIGNER.current.key_id
    document = json.dumps({"keys": [{"key_id": k.key_id, "public_key": k.base64}
                                    for k in Signer(OTHER, (PUBLISHED[0],)).published]})
    assert len(signing_keys.public_keys(document.encode())) == 2
    assert [k.key_id for k in signing_keys.public_keys(PUBLISHED[0].pem.encode())] == [
        SIGNER.current.key_id]
    assert [k.key_id for k in signing_keys.public_keys(PUBLISHED[0].base64.encode())] == [
        SIGNER.current.key_id]
    for bad in (b"", b"not a key", b"-----BEGIN PRIVATE KEY-----\nxx\n-----END PRIVATE KEY-----"):
        with pytest.raises(signing_keys.KeyProblem) as caught:
            signing_keys.private_key(bad)
        assert "xx" not in str(caught.value)
    with pytest.raises(signing_keys.KeyProblem):
        signing_keys.public_keys(b'{"keys": [{"public_key": "short"}]}')


def test_the_local_key_is_made_once_and_kept_private(tmp_path: object) -> None:
    from pathlib import Path
    data_dir = Path(str(tmp_path)) / "data"
    first = signing_keys.local_key(data_dir)
    again = signing_keys.local_key(data_dir)
    assert signing_keys.key_id(first.public_key()) == signing_keys.key_id(again.public_key())
    assert (data_dir / signing_keys.LOCAL_KEY_FILE).stat().st_mode & 0o077 == 0


def confirmed_record(seq: int, confirmed: bool) -> dict[str, Any]:
    """Entry `seq` in the record format written since confirmation reads (0023)."""
    return {**record(seq), "confirmed": confirmed}


def test_records_say_whether_a_read_confirmed_the_deletion_and_old_ones_read_as_before(
        ) -> None:
    # the newer format: its own first line, `confirmed` last as 1 or 0; the older format's
    # bytes (pinned above) are untouched, so what was written before hashes as it did
    data = deletion_records.canonical(confirmed_record(1, True))
    assert data == (b"sweeper-evidence-record/2\n1\n7\n3:run\n4:acme\n6:cart-1\n5:carts\n1\n"
                    b"64:" + b"k" * 64 + b"\n9:succeeded\n204\n1\n1796126400000000\n1")
    assert deletion_records.parse(data) == confirmed_record(1, True)
    assert deletion_records.parse(deletion_records.canonical(confirmed_record(1, False))) \
        == confirmed_record(1, False)
    assert "confirmed" not in deletion_records.parse(deletion_records.canonical(record(1)))
    assert leaf(confirmed_record(1, True)) != leaf(confirmed_record(1, False)) != leaf(record(1))
    for bad in ({**record(1), "confirmed": 1}, {**record(1), "confirmed": None}):
        with pytest.raises(deletion_records.RecordProblem):
            deletion_records.canonical(bad)
    for bad_bytes in (data[:-1] + b"2", data[:-2], data.replace(b"record/2", b"record/9")):
        with pytest.raises(deletion_records.RecordProblem):
            deletion_records.parse(bad_bytes)


def regional_record(seq: int, region: str | None) -> dict[str, Any]:
    """Entry `seq` in the record format written since regions (0029)."""
    return {**confirmed_record(seq, False), "region": region}


def test_records_say_where_the_deletion_was_made_and_older_ones_read_as_before() -> None:
    # format 3: `region` last, a text, or nothing for a worker of no region; formats 1 and
    # 2 (pinned above) are untouched
    data = deletion_records.canonical(regional_record(1, "eu"))
    assert data == (b"sweeper-evidence-record/3\n1\n7\n3:run\n4:acme\n6:cart-1\n5:carts\n1\n"
                    b"64:" + b"k" * 64 + b"\n9:succeeded\n204\n1\n1796126400000000\n0\n2:eu")
    unpinned = deletion_records.canonical(regional_record(1, None))
    assert unpinned == data.removesuffix(b"2:eu")
    for region in ("eu", None, ""):
        assert deletion_records.parse(deletion_records.canonical(
            regional_record(1, region))) == regional_record(1, region)
    assert len({leaf(regional_record(1, r)) for r in ("eu", "us", None, "")} | {
        leaf(confirmed_record(1, False))}) == 5
    assert "region" not in deletion_records.parse(
        deletion_records.canonical(confirmed_record(1, False)))
    with pytest.raises(deletion_records.RecordProblem):
        deletion_records.canonical(regional_record(1, 3))  # type: ignore[arg-type]
    for bad_bytes in (data + b"\n", data[:-1], data.replace(b"2:eu", b"3:eu")):
        with pytest.raises(deletion_records.RecordProblem):
            deletion_records.parse(bad_bytes)


def test_an_export_of_all_three_formats_verifies_and_a_changed_region_fails() -> None:
    records = [record(1), confirmed_record(2, True), regional_record(3, "eu"),
               regional_record(4, None)]
    slices = Slices(SIGNER)
    head = segment_hash(GENESIS, map(leaf, records))
    segment = Segment(1, 4, records, head)
    lines = [slices.checkpoint(GENESIS_CHECKPOINT),
             *(slices.entry(n + 1, r) for n, r in enumerate(records)),
             slices.segment(segment), slices.checkpoint(checkpoint(segment)),
             slices.manifest(next_after=None, exported_at=AT)]
    assert verify(lines, PUBLISHED).records == 4
    assert json.loads(lines[3])["region"] == "eu" and json.loads(lines[4])["region"] is None
    moved = [*lines]
    moved[3] = lines[3].replace(b'"region":"eu"', b'"region":"us"')
    assert moved[3] != lines[3]
    assert "do not hash to their segment's stored hash" in failure(
        [line.rstrip(b"\n") for line in moved]).reason


def test_an_export_mixing_both_record_formats_verifies_and_a_flipped_flag_fails() -> None:
    # entries 1-3 written before 0023, 4-6 after: one log, one chain
    records = [record(1), record(2), record(3), confirmed_record(4, True),
               confirmed_record(5, False), confirmed_record(6, True)]
    slices = Slices(SIGNER)
    lines = [slices.checkpoint(GENESIS_CHECKPOINT)]
    head = GENESIS
    for first, last in ((1, 3), (4, 6)):
        part = records[first - 1:last]
        head = segment_hash(head, map(leaf, part))
        segment = Segment(first, last, part, head)
        lines.extend(slices.entry(first + n, r) for n, r in enumerate(part))
        lines.append(slices.segment(segment))
        lines.append(slices.checkpoint(checkpoint(segment)))
    lines.append(slices.manifest(next_after=None, exported_at=AT))
    assert verify(lines, PUBLISHED).records == 6
    entry = json.loads(lines[6])  # after entries 1-3, their segment and checkpoint
    assert entry["seq"] == 4 and entry["confirmed"] is True
    assert "confirmed" not in json.loads(lines[1])
    flipped = [*lines]
    flipped[6] = lines[6].replace(b'"confirmed":true', b'"confirmed":false')
    assert flipped[6] != lines[6]
    assert "do not hash to their segment's stored hash" in failure(
        [line.rstrip(b"\n") for line in flipped]).reason
