"""The evidence log through the production path: deletions released by a run and by a
webhook hint are appended as the workers complete them, exported over HTTP as slices
between signed checkpoints, and checked by `sweeper evidence verify`. An untouched log
verifies; a row edited, deleted or inserted in SQL, a checkpoint replaced, and exports
spliced together are each caught."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service import cli, evidence, evidence_log, ledger
from service.exits import Exit
from service.upstream import Upstreams
from service.worker import database_pool
from tests.conftest import TOKEN_A, LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import PAST, drain, release_all
from tests.integration.test_webhooks import SHOP, make_policies, post, shopify

KEY = base64.b64encode(bytes(range(7, 39))).decode()
RUN_ITEMS = 5  # entries 1..5 (the run), then 6..7 (webhook hints)


@dataclass
class Setup:
    api: httpx.AsyncClient
    engine: AsyncEngine
    run_id: int
    keys: bytes
    kept: bytes  # GET /v1/evidence/checkpoints, saved before any tamper
    tmp: Path
    upstream: FakeUpstream


async def drain_all(engine: AsyncEngine, upstream: FakeUpstream) -> None:
    policies = make_policies(upstream.base_url)
    ups = Upstreams(policies.upstreams)
    try:
        await drain(database_pool(engine, policies, ups, concurrency=4), engine)
    finally:
        await ups.aclose()


@pytest.fixture
async def logged(db_url: str, engine: AsyncEngine, tmp_path: Path) -> AsyncIterator[Setup]:
    """A log of a run's five deletions (checkpointed by an export), then two deletions
    that webhook hints released (checkpointed by another), and the checkpoints kept."""
    async with FakeUpstream() as upstream:
        policies = make_policies(upstream.base_url)
        await ledger.register(engine, [ledger.Registration(
            "acme", f"cart-{i}", policies.policies["carts"], PAST) for i in range(RUN_ITEMS)])
        run_id = await release_all(engine)
        settings = test_settings(db_url, evidence_signing_key=KEY)
        async with LiveServer(settings, policies, db_url) as live:
            async with httpx.AsyncClient(base_url=live.base_url, timeout=10, headers={
                    "Authorization": f"Bearer {TOKEN_A}"}) as api:
                await drain_all(engine, upstream)
                assert (await api.get("/v1/evidence/log")).status_code == 200
                for customer in (42, 43):
                    answer = await post(api, "shopify", shopify(
                        "customers/redact", {"shop_id": 1, "customer": {"id": customer}}))
                    assert answer.status_code == 202, answer.text
                await drain_all(engine, upstream)
                assert (await api.get("/v1/evidence/log")).status_code == 200
                keys = (await api.get("/v1/evidence/public-key")).content
                kept = (await api.get("/v1/evidence/checkpoints")).content
                yield Setup(api, engine, run_id, keys, kept, tmp_path, upstream)


def verify_cli(setup: Setup, export: bytes, capsys: pytest.CaptureFixture[str], *,
               kept: bool = False) -> tuple[int, str]:
    (setup.tmp / "export.jsonl").write_bytes(export)
    (setup.tmp / "keys.json").write_bytes(setup.keys)
    (setup.tmp / "kept.json").write_bytes(setup.kept)
    args = ["evidence", "verify", str(setup.tmp / "export.jsonl"),
            "--public-key", str(setup.tmp / "keys.json")]
    code = cli.main(args + (["--checkpoints", str(setup.tmp / "kept.json")] if kept else []))
    out, err = capsys.readouterr()
    return code, out + err


def line_of(export: bytes, seq: int) -> int:
    """The 1-based line of entry `seq` in an export."""
    return next(n for n, line in enumerate(export.splitlines(), 1)
                if json.loads(line).get("seq") == seq)


async def sql(engine: AsyncEngine, *statements: str) -> None:
    async with engine.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement))


# What an attacker who knows the format does after changing entries from 3 on: recompute
# every stored hash from entry 3 and the head, so the rows agree with each other again.
REHASH_FROM_3 = f"""
    UPDATE evidence_log e SET hash = c.hash
    FROM (SELECT x.seq, evidence_chain({evidence_log.leaf_sql("x")},
                                       (SELECT hash FROM evidence_log WHERE seq = 2))
                        OVER (ORDER BY x.seq) AS hash
          FROM evidence_log x WHERE x.seq >= 3) c
    WHERE e.seq = c.seq"""
MOVE_HEAD = """
    UPDATE evidence_log_head SET size = (SELECT max(seq) FROM evidence_log),
        hash = (SELECT hash FROM evidence_log ORDER BY seq DESC LIMIT 1)"""


async def test_every_deletion_is_in_a_log_that_verifies(
        logged: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.OK, said
    assert "log range, 7 record(s), entries 1..7, 3 checkpoint(s)" in said, said
    records = [json.loads(line) for line in export.splitlines()
               if "seq" in json.loads(line)]
    assert [(r["released_by"], r["run_id"], r["object_id"]) for r in records] == [
        *(("run", logged.run_id, f"cart-{i}") for i in range(RUN_ITEMS)),
        ("webhook", None, "42"), ("webhook", None, "43")]
    assert {r["tenant_id"] for r in records[RUN_ITEMS:]} == {SHOP}
    assert set(records[0]) == {"seq", "hash", *(n for n, _ in evidence_log.RECORD_FIELDS)}

    # the run's export: the same slices, other runs' entries as their leaf digest only
    run_export = (await logged.api.get(f"/v1/runs/{logged.run_id}/evidence")).content
    code, said = verify_cli(logged, run_export, capsys, kept=True)
    assert code == Exit.OK, said
    assert f"run {logged.run_id}, {RUN_ITEMS} record(s), entries 1..5" in said, said
    assert SHOP.encode() not in run_export

    # pages: bounded, each verifiable alone, the next one named
    first = await logged.api.get("/v1/evidence/log", params={"after": 0, "limit": 2})
    code, said = verify_cli(logged, first.content, capsys)
    assert code == Exit.OK and "entries 1..5" in said and "next page after=5" in said, said
    assert first.headers["link"] == '</v1/evidence/log?after=5&limit=2>; rel="next"'
    second = await logged.api.get("/v1/evidence/log", params={"after": 5, "limit": 2})
    code, said = verify_cli(logged, second.content, capsys)
    assert code == Exit.OK and "entries 6..7" in said and "next page" not in said, said
    assert "link" not in second.headers
    for params, field in (({"after": -1}, "after"), ({"limit": 0}, "limit"),
                          ({"limit": 10_001}, "limit"), ({"after": 2**63}, "after"),
                          ({"after": "x"}, "after"), ({"since": 1}, "since")):
        answer = await logged.api.get("/v1/evidence/log", params=params)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        assert any(field in e["loc"] for e in answer.json()["errors"]), answer.json()
    bad = await logged.api.get("/v1/evidence/checkpoints", params={"limit": 1001})
    assert bad.status_code == 422


@pytest.mark.parametrize("tamper", ["edited", "edited-and-rehashed", "deleted", "inserted"])
async def test_a_row_changed_in_sql_is_caught(logged: Setup, tamper: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    untouched = (await logged.api.get("/v1/evidence/log")).content
    assert verify_cli(logged, untouched, capsys)[0] == Exit.OK
    statements = {
        "edited": ["UPDATE evidence_log SET upstream_status = 404 WHERE seq = 3"],
        "edited-and-rehashed": ["UPDATE evidence_log SET object_id = 'cart-x' WHERE seq = 3",
                                REHASH_FROM_3, MOVE_HEAD],
        "deleted": ["DELETE FROM evidence_log WHERE seq = 4"],
        # a forged deletion slipped in as entry 3, the rest moved up and re-chained
        "inserted": ["UPDATE evidence_log SET seq = seq + 1000 WHERE seq >= 3",
                     "UPDATE evidence_log SET seq = seq - 999 WHERE seq > 1000",
                     "INSERT INTO evidence_log SELECT 3, 999, run_id, released_by, tenant_id,"
                     " 'forged', policy, policy_version, operation_key, outcome,"
                     " upstream_status, attempts, completed_at, hash"
                     " FROM evidence_log WHERE seq = 2",
                     REHASH_FROM_3, MOVE_HEAD],
    }[tamper]
    await sql(logged.engine, *statements)
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.INCOMPLETE, said
    expected = {
        "edited": (line_of(export, 3), "entry 3 does not follow from the entries before it"),
        "edited-and-rehashed": (line_of(export, 5) + 1,
                                "do not hash to this checkpoint's head (size 5)"),
        "deleted": (line_of(export, 5), "entry 5 where entry 4 follows"),
        "inserted": (line_of(export, 5) + 1, "do not hash to this checkpoint's head (size 5)"),
    }[tamper]
    assert f"NOT verified: line {expected[0]}: " in said and expected[1] in said, said
    # the run's export covers the same entries: caught there too
    code, said = verify_cli(
        logged, (await logged.api.get(f"/v1/runs/{logged.run_id}/evidence")).content, capsys)
    assert code == Exit.INCOMPLETE, said


async def test_a_replaced_checkpoint_is_caught(logged: Setup,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # history rewritten and the checkpoint at 5 made to state the rewritten head
    await sql(logged.engine, "UPDATE evidence_log SET upstream_status = 404 WHERE seq = 3",
              REHASH_FROM_3, MOVE_HEAD,
              "UPDATE evidence_checkpoints SET hash = (SELECT hash FROM evidence_log"
              " WHERE seq = 5) WHERE size = 5")
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.INCOMPLETE
    assert (f"line {line_of(export, 5) + 1}: the checkpoint at size 5's signature does not "
            f"verify") in said, said
    # a checkpoint signed by a key that is not published
    other = evidence.Signer(Ed25519PrivateKey.generate())
    forged = evidence_log.Checkpoint(5, bytes(32), evidence_log.GENESIS_CHECKPOINT.signed_at,
                                     other.current.key_id, None)
    line = json.dumps({"checkpoint": forged.statement(),
                       "signature": other.sign(evidence_log.signed_bytes(forged.statement()))})
    lines = export.splitlines(keepends=True)
    lines[line_of(export, 5)] = line.encode() + b"\n"
    code, said = verify_cli(logged, b"".join(lines), capsys)
    assert code == Exit.INCOMPLETE and "which is not among the public keys given" in said


async def test_a_log_rewritten_under_new_checkpoints_is_caught_by_the_kept_ones(
        logged: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    # the attacker rewrites entry 3, re-chains, and deletes the stored checkpoints so the
    # server signs the rewritten log afresh
    await sql(logged.engine, "UPDATE evidence_log SET outcome = 'forged' WHERE seq = 3",
              REHASH_FROM_3, MOVE_HEAD, "DELETE FROM evidence_checkpoints")
    export = (await logged.api.get("/v1/evidence/log")).content
    # alone, the export is consistent: only checkpoints kept outside the database show it
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.OK, said
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.INCOMPLETE
    assert (f"line {line_of(export, 5)}: entry 5 differs from the checkpoint kept at its "
            f"size: the log was rewritten") in said, said


async def test_spliced_exports_are_caught(logged: Setup,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    whole = (await logged.api.get("/v1/evidence/log")).content.splitlines(keepends=True)
    first = (await logged.api.get("/v1/evidence/log", params={"limit": 2})
             ).content.splitlines(keepends=True)
    second = (await logged.api.get("/v1/evidence/log", params={"after": 5})
              ).content.splitlines(keepends=True)
    run = (await logged.api.get(f"/v1/runs/{logged.run_id}/evidence")
           ).content.splitlines(keepends=True)
    splices = {
        # two pages' lines under one page's manifest: the manifest signs other lines
        "pages joined": ([*first[:-1], *second[:-1], first[-1]],
                         "the manifest counts 5 records in 5 entries, the export holds 7"),
        # the run's export with its third entry replaced by another export's fourth
        "entry from another export": ([*run[:3], whole[4], *run[4:]],
                                      "entry 4 where entry 3 follows"),
        # the whole log's lines closed by the run export's manifest
        "manifest from another export": ([*whole[:-1], run[-1]],
                                         "the manifest counts 5 records in 5 entries"),
        # the second page's slice ahead of the first's
        "slices reordered": ([*second[:-1], *first[1:]], "entry 1 where entry 8 follows"),
    }
    for name, (lines, reason) in splices.items():
        code, said = verify_cli(logged, b"".join(lines), capsys)
        assert code == Exit.INCOMPLETE, (name, said)
        assert reason in said, (name, said)


async def test_checkpoints_come_at_their_interval_and_unsigned_ones_are_signed_later(
        logged: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    signer = evidence.Signer(Ed25519PrivateKey.from_private_bytes(base64.b64decode(KEY)))
    engine = logged.engine
    assert await evidence_log.checkpoint(engine, signer, at_head=False, interval_s=0) == 0
    answer = await post(logged.api, "shopify", shopify(
        "customers/redact", {"shop_id": 1, "customer": {"id": 44}}))
    assert answer.status_code == 202, answer.text
    await drain_all(engine, logged.upstream)
    # the log grew by one: due once the interval since the last checkpoint has passed
    assert await evidence_log.checkpoint(engine, signer, at_head=False,
                                         interval_s=3600) == 0
    # a replica with no key stores it unsigned...
    assert await evidence_log.checkpoint(engine, None, at_head=False, interval_s=0) == 1
    [stored] = await evidence_log.checkpoints(engine, after=7, limit=10)
    assert (stored.size, stored.signature) == (8, None)
    # ...and one with the key signs it before it exports
    export = (await logged.api.get("/v1/evidence/log", params={"after": 7})).content
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.OK and "entries 8..8" in said, said
