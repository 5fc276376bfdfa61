"""Deletion evidence end to end: a drained run's export (slices of the evidence log between
signed checkpoints) is what `sweeper evidence verify` accepts and any edit of the file
breaks; exports made before the log still verify; pruning keeps the evidence (for its own
retention period) so the lookup and the export still answer; bad lookups are refused.
Tampering with the stored log: tests/integration/test_evidence_log.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.cluster import retention
from service.commands import cli
from service.commands.exits import Exit
from service.config import signing_keys
from service.evidence import signed_exports, verification
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import drain, make_policies, register, release_all

DAY = 86_400.0
OLD_KEY = base64.b64encode(bytes(range(32))).decode()
NEW_KEY = base64.b64encode(bytes(range(1, 33))).decode()


def public_of(private: str) -> str:
    key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(private))
    return signing_keys.PublicKey(key.public_key()).base64



async def drained_run(engine: AsyncEngine, upstream: FakeUpstream, n: int) -> int:
    policies = make_policies(upstream.base_url)
    await register(engine, policies, n)
    run_id = await release_all(engine)
    ups = Upstreams(policies.upstreams)
    try:
        await drain(database_pool(engine, policies, ups, concurrency=8), engine)
    finally:
        await ups.aclose()
    return run_id


def verify_cli(tmp_path: Path, export: bytes, keys: bytes,
               capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    (tmp_path / "run.jsonl").write_bytes(export)
    (tmp_path / "keys.json").write_bytes(keys)
    code = cli.main(["evidence", "verify", str(tmp_path / "run.jsonl"),
                     "--public-key", str(tmp_path / "keys.json")])
    out, err = capsys.readouterr()
    return code, out + err


async def test_an_export_verifies_offline_and_every_edit_is_named(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run_id = await drained_run(engine, upstream, 12)
    # rotation: the current key signs; the earlier one stays published
    settings = test_settings(db_url, evidence_signing_key=NEW_KEY,
                             evidence_previous_public_keys=public_of(OLD_KEY))
    async with LiveServer(settings, make_policies(upstream.base_url), db_url) as live:
        async with live.client() as api:
            export = (await api.get(f"/v1/runs/{run_id}/evidence")).content
            keys = await api.get("/v1/evidence/public-key")
            empty = await api.get(f"/v1/runs/{run_id + 1}/evidence")
    assert keys.status_code == 200
    assert [k["current"] for k in keys.json()["keys"]] == [True, False]
    assert NEW_KEY not in keys.text and NEW_KEY not in export.decode()
    assert empty.status_code == 404

    code, said = verify_cli(tmp_path, export, keys.content, capsys)
    assert code == Exit.OK, said
    assert f"run {run_id}, 12 record(s), entries 1..12" in said

    # genesis, entries 1..12 in their segments, the checkpoint the export made at 12, the
    # manifest; `at(n)`: entry n's index among the lines
    lines = export.splitlines(keepends=True)
    at = {json.loads(line).get("seq"): n for n, line in enumerate(lines)}.__getitem__
    closing = next(n for n, line in enumerate(lines)
                   if n > at(3) and b'"segment"' in line)  # the segment line after entry 3
    edits = {
        "changed": ([*lines[:at(3)], lines[at(3)].replace(b'"upstream_status":204',
                                                          b'"upstream_status":404'),
                     *lines[at(3) + 1:]], closing + 1),
        "dropped": ([*lines[:at(5)], *lines[at(5) + 1:]], at(5) + 1),
        "reordered": ([*lines[:at(2)], lines[at(3)], lines[at(2)], *lines[at(3) + 1:]],
                      at(2) + 1),
        "inserted": ([*lines[:at(7)], lines[at(1)], *lines[at(7):]], at(7) + 1),
        "truncated": (lines[:-1], len(lines)),
        "cut before the checkpoint": ([*lines[:-2], lines[-1]], len(lines) - 1),
    }
    for name, (edited, line) in edits.items():
        code, said = verify_cli(tmp_path, b"".join(edited), keys.content, capsys)
        assert code == Exit.INCOMPLETE, (name, said)
        assert f"NOT verified: line {line}:" in said, (name, said)
    code, said = verify_cli(tmp_path, export, b"not a key", capsys)
    assert code == Exit.CONFIG and "neither PEM nor base64" in said


def test_an_export_made_before_the_log_still_verifies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sweeper-evidence/1: lines chained by `prev` at export, closed by a signed manifest."""
    signer = signing_keys.Signer(Ed25519PrivateKey.from_private_bytes(base64.b64decode(OLD_KEY)))
    prev, lines = signed_exports.genesis(7), []
    for n in range(3):
        line = json.dumps({"item_id": n + 1, "object_id": f"cart-{n}", "run_id": 7,
                           "prev": prev}).encode()
        lines.append(line + b"\n")
        prev = signed_exports.digest(line)
    manifest = {"format": signed_exports.FORMAT, "run_id": 7, "records": 3, "last": prev,
                "exported_at": "2026-12-01T00:00:00+00:00", "key_id": signer.current.key_id}
    signature = signer.sign(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    lines.append(json.dumps({"manifest": manifest, "signature": signature}).encode() + b"\n")
    keys = public_of(OLD_KEY).encode()
    code, said = verify_cli(tmp_path, b"".join(lines), keys, capsys)
    assert code == Exit.OK and "run 7, 3 record(s)" in said and "sweeper-evidence/1" in said
    code, said = verify_cli(tmp_path, b"".join([lines[0], lines[2], lines[3]]), keys, capsys)
    assert code == Exit.INCOMPLETE and "NOT verified: line 2:" in said


async def test_pruning_keeps_the_evidence_for_its_own_period(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    run_id = await drained_run(engine, upstream, 5)
    async with engine.begin() as conn:  # finished 40 days ago
        await conn.execute(text(
            "UPDATE items SET completed_at = now() - interval '40 days'"))
    pruned = await retention.prune(engine, keep_seconds=30 * DAY, batch_size=2,
                                   evidence_keep_seconds=365 * DAY)
    assert (pruned.items, pruned.evidence) == (5, 0)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM items"))).scalar_one() == 0
        kept = (await conn.execute(text(
            "SELECT run_id, object_id, outcome, upstream_status FROM evidence "
            "ORDER BY item_id"))).all()
    assert [tuple(k) for k in kept] == [(run_id, f"cart-{i}", "succeeded", 204)
                                        for i in range(5)]

    settings = test_settings(db_url, evidence_signing_key=NEW_KEY)
    async with LiveServer(settings, make_policies(upstream.base_url), db_url) as live:
        async with live.client() as api:
            found = (await api.get("/v1/evidence", params={
                "tenant_id": "acme", "object_id": "cart-3"})).json()
            export = (await api.get(f"/v1/runs/{run_id}/evidence")).content
            keys = [signing_keys.PublicKey(Ed25519PrivateKey.from_private_bytes(
                base64.b64decode(NEW_KEY)).public_key())]
            assert found["deleted"] and len(found["deletions"]) == 1
            [deletion] = found["deletions"]
            assert (deletion["kept_in"], deletion["run_id"], deletion["policy"],
                    deletion["policy_version"], deletion["upstream_status"]) == (
                "evidence", run_id, "carts", 1, 204)
            verified = verification.verify(export.splitlines(keepends=True), keys)
            assert verified.records == 5

            # past the evidence's own period it goes too, and the answer says so
            pruned = await retention.prune(engine, keep_seconds=30 * DAY, batch_size=2,
                                           evidence_keep_seconds=39 * DAY)
            assert pruned.evidence == 5
            gone = (await api.get("/v1/evidence", params={
                "tenant_id": "acme", "object_id": "cart-3"})).json()
            assert gone == {"tenant_id": "acme", "object_id": "cart-3", "deleted": False,
                            "deletions": []}


async def test_a_live_item_answers_from_the_ledger_and_bad_lookups_are_refused(
        db_url: str, engine: AsyncEngine, upstream: FakeUpstream) -> None:
    run_id = await drained_run(engine, upstream, 2)
    async with LiveServer(test_settings(db_url), make_policies(upstream.base_url),
                          db_url) as live:
        async with live.client() as api:
            found = (await api.get("/v1/evidence", params={
                "tenant_id": "acme", "object_id": "cart-1"})).json()
            assert found["deleted"] and found["deletions"][0]["kept_in"] == "ledger"
            assert found["deletions"][0]["run_id"] == run_id
            # no key configured: the export is unsigned and says so; no key to publish
            export = (await api.get(f"/v1/runs/{run_id}/evidence")).content
            manifest: dict[str, Any] = json.loads(export.splitlines()[-1])
            assert manifest["signature"] is None and manifest["manifest"]["key_id"] is None
            unsigned = await api.get("/v1/evidence/public-key")
            assert unsigned.status_code == 404
            assert unsigned.json()["type"].endswith("evidence-unsigned")
            for params, field in (({"tenant_id": "acme"}, "object_id"),
                                  ({"tenant_id": "", "object_id": "x"}, "tenant_id"),
                                  ({"tenant_id": "acme", "object_id": "x" * 513}, "object_id"),
                                  ({"tenant_id": "acme", "object_id": ".."}, "object_id"),
                                  ({"tenant_id": "acme", "object_id": "a\u0085"}, "object_id"),
                                  ({"tenant_id": "a", "object_id": "b", "limit": 0}, "limit"),
                                  ({"tenant_id": "a", "object_id": "b", "objectid": "c"},
                                   "objectid")):
                r = await api.get("/v1/evidence", params=params)
                assert r.status_code == 422, (params, r.text)
                assert any(field in e["loc"] for e in r.json()["errors"]), r.json()
