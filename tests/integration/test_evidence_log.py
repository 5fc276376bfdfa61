"""The evidence log through the production path: deletions released by a run and by a
webhook hint are appended as the workers complete them, exported over HTTP as slices
between signed checkpoints, and checked by `sweeper evidence verify`. An untouched log
verifies; a row edited, deleted or inserted in SQL, a checkpoint replaced, and exports
spliced together are each caught."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from service.commands import cli
from service.commands.exits import Exit
from service.config import signing_keys
from service.evidence import chain, deletion_records, export_slices, verification
from service.ledger import claims, completions, registration
from service.upstreams.deletion_api import Upstreams
from service.worker import database_pool
from tests.conftest import LiveServer, test_settings
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_pipeline import PAST, drain, release_all, succeeded
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
        await registration.register(engine, [registration.Registration(
            "acme", f"cart-{i}", policies.policies["carts"], PAST) for i in range(RUN_ITEMS)])
        run_id = await release_all(engine)
        settings = test_settings(db_url, evidence_signing_key=KEY)
        async with LiveServer(settings, policies, db_url) as live:
            async with live.client() as api:
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


def line_where(export: bytes, kind: str, after: int = 0, **fields: int) -> int:
    """The 1-based line of the first `kind` line ("segment", "checkpoint") past line
    `after` whose object has `fields` (e.g. last=5, size=5)."""
    return next(n for n, line in enumerate(export.splitlines(), 1)
                if n > after and kind in (obj := json.loads(line))
                and all(obj[kind].get(k) == v for k, v in fields.items()))


async def sql(engine: AsyncEngine, *statements: str) -> None:
    async with engine.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement))


# An edit of stored bytes in place: entry 3's object id (same length, so still well formed).
async def edit_entry_3(engine: AsyncEngine) -> None:
    """Entry 3's object id changed in place, in its canonical form and length, its
    segment's hash left as it was. (Entry 3 is whichever item completed third: a 'cart-2'
    replaced in its segment's bytes missed it whenever completions ran in another order.)"""
    async with engine.begin() as conn:
        row = (await conn.execute(text(
            "SELECT seq_start, records FROM evidence_log"
            " WHERE seq_start <= 3 AND seq_end >= 3"))).one()
        records = deletion_records.frames(bytes(row.records))
        entry = deletion_records.parse(records[3 - row.seq_start])
        other = entry["object_id"][:-1] + ("8" if entry["object_id"].endswith("9") else "9")
        records[3 - row.seq_start] = deletion_records.canonical({**entry, "object_id": other})
        await conn.execute(text(
            "UPDATE evidence_log SET records = :records WHERE seq_start = :start"),
            {"records": b"".join(len(r).to_bytes(4, "big") + r for r in records),
             "start": row.seq_start})


async def stored_segments(engine: AsyncEngine) -> list[list[bytes]]:
    """Every segment's records (canonical bytes), in log order."""
    async with engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT records FROM evidence_log ORDER BY seq_end"))).all()
    return [deletion_records.frames(bytes(r.records)) for r in rows]


async def rewrite_log(engine: AsyncEngine, segments: list[list[bytes]]) -> None:
    """What an attacker who knows the format does: store these segments numbered from 1
    and chained afresh, and move the head to their end, so the rows agree again."""
    head, size, rows = deletion_records.GENESIS, 0, []
    for records in segments:
        head = deletion_records.segment_hash(head, [hashlib.sha256(r).digest()
                                                    for r in records])
        runs = sorted({run for r in records
                       if (run := deletion_records.parse(r)["run_id"]) is not None})
        rows.append({"start": size + 1, "end": size + len(records), "runs": runs,
                     "records": b"".join(len(r).to_bytes(4, "big") + r for r in records),
                     "hash": head})
        size += len(records)
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM evidence_log"))
        for row in rows:
            await conn.execute(text(
                "INSERT INTO evidence_log (seq_start, seq_end, runs, records, hash)"
                " VALUES (:start, :end, :runs, :records, :hash)"), row)
        await conn.execute(text("UPDATE evidence_log_head SET size = :size, hash = :hash"),
                           {"size": size, "hash": head})


async def edited_and_rehashed(engine: AsyncEngine) -> None:
    """Entry 3's object id changed, and the log re-chained after it."""
    await edit_entry_3(engine)
    await rewrite_log(engine, await stored_segments(engine))


async def test_every_deletion_is_in_a_log_that_verifies(
        logged: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.OK, said
    assert "log range, 7 record(s), entries 1..7, 3 checkpoint(s)" in said, said
    records = [json.loads(line) for line in export.splitlines()
               if "seq" in json.loads(line)]
    # the run's items in the order their calls completed, then the hints' (drained after)
    entries = [(r["released_by"], r["run_id"], r["object_id"]) for r in records]
    assert sorted(entries[:RUN_ITEMS]) == [("run", logged.run_id, f"cart-{i}")
                                           for i in range(RUN_ITEMS)]
    assert sorted(entries[RUN_ITEMS:]) == [("webhook", None, "42"), ("webhook", None, "43")]
    assert {r["tenant_id"] for r in records[RUN_ITEMS:]} == {SHOP}
    assert set(records[0]) == {"seq", *(n for n, _ in deletion_records.RECORD_FIELDS)}

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
                          ({"after": "x"}, "after"), ({"since": 1}, "since"),
                          # after + limit must stay a bigint: a 500 once
                          ({"after": 2**63 - 2, "limit": 1000}, "after")):
        answer = await logged.api.get("/v1/evidence/log", params=params)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.headers["content-type"] == "application/problem+json"
        assert any(field in e["loc"] for e in answer.json()["errors"]), answer.json()
    edge = await logged.api.get("/v1/evidence/log",
                                params={"after": 2**63 - 1 - 10_000, "limit": 10_000})
    assert edge.status_code == 200, edge.text
    bad = await logged.api.get("/v1/evidence/checkpoints", params={"limit": 1001})
    assert bad.status_code == 422


@pytest.mark.parametrize("tamper", ["edited", "edited-and-rehashed", "deleted", "inserted"])
async def test_a_row_changed_in_sql_is_caught(logged: Setup, tamper: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    untouched = (await logged.api.get("/v1/evidence/log")).content
    assert verify_cli(logged, untouched, capsys)[0] == Exit.OK
    engine = logged.engine
    async with engine.connect() as conn:
        segment_of_3 = (await conn.execute(text(
            "SELECT seq_start, seq_end FROM evidence_log"
            " WHERE seq_start <= 3 AND seq_end >= 3"))).one()
    if tamper == "edited":
        await edit_entry_3(engine)
    elif tamper == "edited-and-rehashed":
        await edited_and_rehashed(engine)
    elif tamper == "deleted":
        await sql(engine, "DELETE FROM evidence_log WHERE seq_start <= 3 AND seq_end >= 3")
    else:  # a forged deletion slipped in before entry 3, the rest renumbered and re-chained
        segments = await stored_segments(engine)
        forged = deletion_records.canonical({
            **deletion_records.parse(segments[0][0]), "item_id": 999, "object_id": "forged"})
        start = 1
        for records in segments:
            if start <= 3 < start + len(records):
                records.insert(3 - start, forged)  # becomes entry 3
                break
            start += len(records)
        await rewrite_log(engine, segments)
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.INCOMPLETE, said
    if tamper == "edited":
        line = line_where(export, "segment", last=segment_of_3.seq_end)
        reason = "do not hash to their segment's stored hash"
    elif tamper == "deleted":
        line = line_of(export, segment_of_3.seq_end + 1)
        reason = f"where entry {segment_of_3.seq_start} follows"
    else:  # re-chained: the stored hashes agree, the first signed checkpoint past entry 3
        # does not (where it falls depends on how completions grouped the entries)
        size = min(obj["checkpoint"]["size"] for line in export.splitlines()
                   if "checkpoint" in (obj := json.loads(line))
                   and obj["checkpoint"]["size"] >= 3)
        line = line_where(export, "checkpoint", size=size)
        reason = f"do not hash to this checkpoint's head (size {size})"
    assert f"NOT verified: line {line}: " in said and reason in said, said
    # the run's export covers the same entries: caught there too
    code, said = verify_cli(
        logged, (await logged.api.get(f"/v1/runs/{logged.run_id}/evidence")).content, capsys)
    assert code == Exit.INCOMPLETE, said


async def test_a_replaced_checkpoint_is_caught(logged: Setup,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # history rewritten and the checkpoint at 5 made to state the rewritten head
    await edited_and_rehashed(logged.engine)
    await sql(logged.engine, "UPDATE evidence_checkpoints SET hash = (SELECT hash"
                             " FROM evidence_log WHERE seq_end = 5) WHERE size = 5")
    export = (await logged.api.get("/v1/evidence/log")).content
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.INCOMPLETE
    assert (f"line {line_where(export, 'checkpoint', size=5)}: the checkpoint at size 5's "
            f"signature does not verify") in said, said
    # a checkpoint signed by a key that is not published
    other = signing_keys.Signer(Ed25519PrivateKey.generate())
    forged = chain.Checkpoint(5, bytes(32), chain.GENESIS_CHECKPOINT.signed_at,
                              other.current.key_id, None)
    line = json.dumps({"checkpoint": forged.statement(),
                       "signature": other.sign(chain.signed_bytes(forged.statement()))})
    lines = export.splitlines(keepends=True)
    lines[line_where(export, "checkpoint", size=5) - 1] = line.encode() + b"\n"
    code, said = verify_cli(logged, b"".join(lines), capsys)
    assert code == Exit.INCOMPLETE and "which is not among the public keys given" in said


async def test_a_log_rewritten_under_new_checkpoints_is_caught_by_the_kept_ones(
        logged: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    # the attacker rewrites entry 3, re-chains, and deletes the stored checkpoints so the
    # server signs the rewritten log afresh
    await edited_and_rehashed(logged.engine)
    await sql(logged.engine, "DELETE FROM evidence_checkpoints")
    export = (await logged.api.get("/v1/evidence/log")).content
    # alone, the export is consistent: only checkpoints kept outside the database show it
    code, said = verify_cli(logged, export, capsys)
    assert code == Exit.OK, said
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.INCOMPLETE
    assert (f"line {line_where(export, 'segment', last=5)}: the log at 5 differs from the "
            f"checkpoint kept at that size: the log was rewritten") in said, said


async def test_spliced_exports_are_caught(logged: Setup,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    whole = (await logged.api.get("/v1/evidence/log")).content.splitlines(keepends=True)
    first = (await logged.api.get("/v1/evidence/log", params={"limit": 2})
             ).content.splitlines(keepends=True)
    second = (await logged.api.get("/v1/evidence/log", params={"after": 5})
              ).content.splitlines(keepends=True)
    run = (await logged.api.get(f"/v1/runs/{logged.run_id}/evidence")
           ).content.splitlines(keepends=True)
    run_3 = line_of(b"".join(run), 3)
    splices = {
        # two pages' lines under one page's manifest: the manifest signs other lines
        "pages joined": ([*first[:-1], *second[:-1], first[-1]],
                         "the manifest counts 5 records in 5 entries, the export holds 7"),
        # the run's export with its third entry replaced by another export's fourth
        "entry from another export": (
            [*run[:run_3 - 1], whole[line_of(b"".join(whole), 4) - 1], *run[run_3:]],
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
    signer = signing_keys.Signer(Ed25519PrivateKey.from_private_bytes(base64.b64decode(KEY)))
    engine = logged.engine
    assert await chain.checkpoint(engine, signer, at_head=False, interval_s=0) == 0
    answer = await post(logged.api, "shopify", shopify(
        "customers/redact", {"shop_id": 1, "customer": {"id": 44}}))
    assert answer.status_code == 202, answer.text
    await drain_all(engine, logged.upstream)
    # the log grew by one: due once the interval since the last checkpoint has passed
    assert await chain.checkpoint(engine, signer, at_head=False,
                                  interval_s=3600) == 0
    # a replica with no key stores it unsigned...
    assert await chain.checkpoint(engine, None, at_head=False, interval_s=0) == 1
    [stored] = await chain.checkpoints(engine, after=7, limit=10)
    assert (stored.size, stored.signature) == (8, None)
    # ...and one with the key signs it before it exports
    export = (await logged.api.get("/v1/evidence/log", params={"after": 7})).content
    code, said = verify_cli(logged, export, capsys, kept=True)
    assert code == Exit.OK and "entries 8..8" in said, said


async def test_completions_racing_for_the_head_append_one_chain(
        engine: AsyncEngine, db_url: str) -> None:
    """Four completions on four connections queue on the head row (held here until all
    four wait), then append in turn: contiguous segments that verify as one chain."""
    policies = make_policies()
    await registration.register(engine, [registration.Registration(
        "acme", f"cart-{i}", policies.policies["carts"], PAST) for i in range(20)])
    await release_all(engine)
    batches = []
    for owner in ("w1", "w2", "w3", "w4"):
        admission = await claims.admit(engine, owner=owner, wants={"tenant:acme": 5},
                                       lease_seconds={"carts": 60})
        batches.append([succeeded(lease) for lease in admission.leases])
    assert sorted(len(b) for b in batches) == [5, 5, 5, 5]
    holder, watcher = await asyncpg.connect(db_url), await asyncpg.connect(db_url)
    try:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM evidence_log_head WHERE id = 1 FOR UPDATE")
            racing = [asyncio.create_task(completions.complete(engine, b)) for b in batches]
            async with asyncio.timeout(30):  # until all four wait on a lock
                while await watcher.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database()") < 4:
                    await asyncio.sleep(0.01)
        assert [await task for task in racing] == [[], [], [], []]  # none fenced
    finally:
        await holder.close()
        await watcher.close()
    async with engine.connect() as conn:
        stored = (await conn.execute(text(
            "SELECT seq_start, seq_end FROM evidence_log ORDER BY seq_end"))).all()
    assert [tuple(r) for r in stored] == [(1, 5), (6, 10), (11, 15), (16, 20)]
    signer = signing_keys.Signer(Ed25519PrivateKey.from_private_bytes(base64.b64decode(KEY)))
    lines, _ = await export_slices.range_export(engine, signer, after=0, limit=100)
    export = b"".join([chunk async for chunk in lines])
    verified = verification.verify(export.splitlines(keepends=True),
                                      [signer.current])
    assert (verified.records, verified.first_seq, verified.last_seq) == (20, 1, 20)
