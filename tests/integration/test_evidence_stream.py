"""Evidence streams page by page over a real HTTP server: readers that stop reading hold no
database connection, a complete read has every record once in id order, and a stream whose
database goes away part way ends in an error the client sees, never a clean short body."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from service.config import signing_keys
from service.config.policies import Policies
from service.evidence import chain, verification
from service.evidence.deletion_records import canonical_sql
from tests.conftest import TOKEN_A, LiveServer, test_settings

# Items of the seeded run: about 11 MB of evidence, far more than a stalled reader's socket
# buffers take in (the server's send buffer grows to net.ipv4.tcp_wmem's 4 MB at most).
RUN_ITEMS = 36_000
# A stalled reader's receive buffer, fixed (no autotuning): smaller ones slow a resumed
# read to a crawl (a window of a few segments per delayed acknowledgement).
READER_RCVBUF_BYTES = 64 * 1024
STALLED_READERS = 5  # more than the pool's connections
STREAMS_FILLED_S = 60.0  # until every stalled reader's stream waits on its send
POOL_SIZE = 2
# A request that needed one of the readers' connections would wait out the pool's timeout;
# answering well within it shows the readers hold none (a loaded machine takes seconds).
POOL_TIMEOUT_S = 30.0
PROMPT_S = 10.0
KEY_BYTES = bytes(range(3, 35))
pytestmark = pytest.mark.slow  # each test seeds 72,000 items (about 2 s)
PUBLIC = signing_keys.PublicKey(Ed25519PrivateKey.from_private_bytes(KEY_BYTES).public_key())


# The succeeded items with ids in ($1, $2] appended to the evidence log as one segment in
# id order, chained, as a completion would have (the items are written directly: 72,000
# drained would take minutes), and the head moved past them.
APPEND_SEGMENT = f"""
    WITH deleted AS (
        SELECT i.id AS item_id, b.run_id, 'run' AS released_by, i.tenant_id, i.object_id,
               i.policy, i.policy_version, i.operation_key, i.last_outcome AS outcome,
               i.last_status_code AS upstream_status, i.attempts, i.completed_at,
               false AS confirmed, CAST(NULL AS text) AS region
        FROM items i JOIN batches b ON b.id = i.batch_id
        WHERE i.status = 'succeeded' AND i.id > $1 AND i.id <= $2
    ),
    canonical AS (SELECT d.item_id, d.run_id, {canonical_sql("d")} AS bytes FROM deleted d),
    head AS (SELECT size, hash FROM evidence_log_head WHERE id = 1),
    segment AS (
        SELECT head.size + 1 AS seq_start, head.size + count(*) AS seq_end,
               array_agg(DISTINCT c.run_id) AS runs,
               string_agg(int4send(octet_length(c.bytes)) || c.bytes, ''::bytea
                          ORDER BY c.item_id) AS records,
               sha256(head.hash || string_agg(sha256(c.bytes), ''::bytea
                                              ORDER BY c.item_id)) AS hash
        FROM canonical c, head GROUP BY head.size, head.hash
    ),
    logged AS (INSERT INTO evidence_log SELECT seq_end, seq_start, runs, records, hash
               FROM segment)
    UPDATE evidence_log_head h SET size = s.seq_end, hash = s.hash FROM segment s
    WHERE h.id = 1"""


async def append_succeeded(conn: asyncpg.Connection, per_segment: int) -> None:
    """Every succeeded item appended to the log, `per_segment` item ids a segment."""
    last = await conn.fetchval("SELECT max(id) FROM items")
    for after in range(0, last, per_segment):
        await conn.execute(APPEND_SEGMENT, after, after + per_segment)


async def seed(db_url: str) -> tuple[int, list[int]]:
    """A published run of RUN_ITEMS items, interleaved in id order with as many items of
    another run, every 50th dead and the rest succeeded: the run's id and the ids its
    evidence must list, in order."""
    conn = await asyncpg.connect(db_url)
    try:
        async with conn.transaction():
            run_id, other = [r["id"] for r in await conn.fetch(
                "INSERT INTO runs (request_digest, cutoff, state, published_at)"
                " VALUES ('seed', now(), 'published', now()), ('other', now(), 'published',"
                " now()) RETURNING id")]
            # batches of 1,000: the even ones are the seeded run's, the odd ones the other's
            await conn.execute(
                "INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count)"
                " SELECT CASE WHEN b % 2 = 0 THEN $1::bigint ELSE $2::bigint END, b,"
                "        md5('b' || b) || md5('batch' || b), 'carts', 1, 1000"
                " FROM generate_series(0, $3::int / 500 - 1) b ORDER BY b",
                run_id, other, RUN_ITEMS)
            first_batch = await conn.fetchval("SELECT min(id) FROM batches")
            # item g is the (g / 2)th item of run g % 2 (0: the seeded run)
            await conn.execute(
                "INSERT INTO items (tenant_id, object_id, policy, policy_version,"
                " operation_key, scope, status, due_at, attempts, released_at, batch_id,"
                " last_outcome, last_status_code, completed_at, dead_reason)"
                " SELECT 'acme.myshopify.com', 'cart-' || lpad(g::text, 24, '0'), 'carts', 1,"
                "   md5(g::text) || md5('key' || g), 'tenant:acme.myshopify.com',"
                "   CASE WHEN dead THEN 'dead' ELSE 'succeeded' END,"
                "   now() - interval '1 day', 1, now(), $1::bigint + 2 * (g / 2 / 1000) + g % 2,"
                "   CASE WHEN dead THEN 'permanent' ELSE 'succeeded' END,"
                "   CASE WHEN dead THEN 422 ELSE 204 END, now(),"
                "   CASE WHEN dead THEN 'http_422' END"
                " FROM generate_series(0, 2 * $2::int - 1) g,"
                "      LATERAL (SELECT g / 2 % 50 = 49 AS dead) d",
                first_batch, RUN_ITEMS)
            await append_succeeded(conn, 1000)
            expected = [r["id"] for r in await conn.fetch(
                "SELECT i.id FROM items i JOIN batches b ON b.id = i.batch_id"
                " WHERE b.run_id = $1 AND i.status = 'succeeded' ORDER BY i.id", run_id)]
        await conn.execute("ANALYZE items")
    finally:
        await conn.close()
    assert len(expected) == RUN_ITEMS * 49 // 50
    return run_id, expected


@pytest.fixture
async def live(db_url: str) -> AsyncIterator[tuple[str, int, list[int]]]:
    run_id, expected = await seed(db_url)
    settings = test_settings(db_url, db_pool_size=POOL_SIZE, shutdown_grace_seconds=1,
                             db_pool_timeout_seconds=POOL_TIMEOUT_S,
                             evidence_signing_key=base64.b64encode(KEY_BYTES).decode())
    async with LiveServer(settings, Policies.empty(), db_url) as server:
        yield server.base_url, run_id, expected


def client(base_url: str, *, fixed_buffer: bool = False) -> httpx.AsyncClient:
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_RCVBUF_BYTES)] if fixed_buffer \
        else []
    return httpx.AsyncClient(base_url=base_url, timeout=10,
                             headers={"Authorization": f"Bearer {TOKEN_A}"},
                             transport=httpx.AsyncHTTPTransport(socket_options=options))


async def stalled_reader(stack: contextlib.AsyncExitStack, base_url: str, run_id: int
                         ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
    """A reader that took the headers and one chunk, then stopped reading (left open)."""
    api = await stack.enter_async_context(client(base_url, fixed_buffer=True))
    response = await stack.enter_async_context(api.stream("GET", f"/v1/runs/{run_id}/evidence"))
    assert response.status_code == 200
    chunks = response.aiter_raw()
    assert await anext(chunks)
    return response, chunks


async def read_into(body: bytearray, chunks: AsyncIterator[bytes]) -> None:
    async for chunk in chunks:
        body += chunk


def records_of(body: bytes) -> list[dict[str, Any]]:
    """The record lines of an export (or of part of one): not the checkpoints, the other
    run's entries (their leaf only) or the manifest."""
    return [record for record in map(json.loads, body.splitlines()) if "item_id" in record]


async def transactions_held(db_url: str) -> list[tuple[Any, ...]]:
    """The service's sessions on the database that are inside a transaction."""
    conn = await asyncpg.connect(db_url)
    try:
        return [tuple(r) for r in await conn.fetch(
            "SELECT pid, state, query FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'sweeper' AND state NOT IN ('idle', 'disabled')")]
    finally:
        await conn.close()


async def test_stalled_readers_hold_no_connection(live: tuple[str, int, list[int]],
                                                  db_url: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    base_url, run_id, expected = live
    async with contextlib.AsyncExitStack() as stack:
        readers = [await stalled_reader(stack, base_url, run_id)
                   for _ in range(STALLED_READERS)]
        # the server fills each reader's buffers, then waits on its send: from then on no
        # session is left inside a transaction (a server-side cursor held one per reader).
        # Filling five readers' buffers from 72,000 records took over 5 s once on a slow,
        # loaded machine: this is a guard against a hang, not the promptness (PROMPT_S).
        async with asyncio.timeout(STREAMS_FILLED_S):
            while await transactions_held(db_url):
                await asyncio.sleep(0.1)

        async with client(base_url) as api:
            started = time.monotonic()
            ready = await asyncio.wait_for(api.get("/readyz"), PROMPT_S)
            run = await asyncio.wait_for(api.get(f"/v1/runs/{run_id}"), PROMPT_S)
            assert ready.status_code == 200 and run.status_code == 200
            assert run.json()["id"] == run_id and time.monotonic() - started < PROMPT_S
        # every stream is still open on the server: none has been logged as a request yet
        assert not [r for r in caplog.records
                    if getattr(r, "http.route", "").endswith("/evidence")]

        # a stalled reader that resumes gets the rest, complete
        response, chunks = readers[0]
        body = bytearray()
        await read_into(body, chunks)
        # the first chunk is not in `body`: count the records it carried from the whole
        assert response.is_stream_consumed
        tail = records_of(bytes(body)[bytes(body).index(b"\n") + 1:])
        assert [r["item_id"] for r in tail] == expected[-len(tail):]


async def test_a_complete_read_has_every_record_once_in_id_order(
        live: tuple[str, int, list[int]]) -> None:
    base_url, run_id, expected = live
    async with client(base_url) as api:
        response = await api.get(f"/v1/runs/{run_id}/evidence")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    records = records_of(response.content)
    assert [r["item_id"] for r in records] == expected  # pages of 1,000: many seams crossed
    assert set(records[0]) == {"item_id", "tenant_id", "object_id", "policy", "policy_version",
                               "operation_key", "outcome", "upstream_status", "attempts",
                               "completed_at", "run_id", "released_by", "confirmed", "region",
                               "seq"}
    assert json.loads(response.content.splitlines()[-1])["manifest"]["records"] == len(expected)
    # the spans of the log that hold the run's entries, each between checkpoints, verify
    verified = verification.verify(response.content.splitlines(keepends=True), [PUBLIC])
    assert verified.records == len(expected) and verified.run_id == run_id
    assert verified.entries > verified.records  # the other run's entries: their leaf only
    assert {(r["outcome"], r["upstream_status"], r["attempts"], r["confirmed"])
            for r in records} == {("succeeded", 204, 1, False)}


@pytest.mark.parametrize("page_segments", [1, 2, 8])
async def test_pages_are_never_empty_and_never_repeat(engine: AsyncEngine, db_url: str,
                                                      page_segments: int) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        run_id = await conn.fetchval(
            "INSERT INTO runs (request_digest, cutoff) VALUES ('r', now()) RETURNING id")
        batch = await conn.fetchval(
            "INSERT INTO batches (run_id, seq, digest, policy, policy_version, item_count)"
            " VALUES ($1, 0, repeat('a', 64), 'carts', 1, 14) RETURNING id", run_id)
        ids = [r["id"] for r in await conn.fetch(
            "INSERT INTO items (tenant_id, object_id, policy, policy_version, operation_key,"
            " scope, status, due_at, released_at, batch_id, completed_at, last_outcome,"
            " last_status_code)"
            " SELECT 'acme', 'c' || g, 'carts', 1, md5(g::text) || md5('k' || g), 'tenant:acme',"
            " 'succeeded', now(), now(), $1, now(), 'succeeded', 204"
            " FROM generate_series(1, 14) g RETURNING id", batch)]
        await append_succeeded(conn, 3)  # segments ending at 3, 6, 9, 12, 14
    finally:
        await conn.close()
    pages = [page async for page in chain.segments(engine, 0, 14,
                                                   page_segments=page_segments)]
    assert all(0 < len(page) <= page_segments for page in pages)
    found = [s for page in pages for s in page]
    assert [s.seq_end for s in found] == [3, 6, 9, 12, 14]
    assert [r["item_id"] for s in found for r in s.records] == sorted(ids)
    middle = [s.seq_end async for page in chain.segments(
        engine, 3, 9, page_segments=page_segments) for s in page]
    assert middle == [6, 9]
    assert [page async for page in chain.segments(engine, 14, 20)] == []


async def test_a_stream_whose_database_goes_away_ends_in_a_client_error(
        live: tuple[str, int, list[int]], pg_server_url: str, db_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    base_url, run_id, expected = live
    name = make_url(db_url).database
    admin = await asyncpg.connect(pg_server_url)
    try:
        async with contextlib.AsyncExitStack() as stack:
            _, chunks = await stalled_reader(stack, base_url, run_id)
            # mid-stream the database refuses connections and its sessions are ended
            await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                " WHERE datname = $1", name)
            body = bytearray()
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                await read_into(body, chunks)
        # what arrived is whole lines, and fewer than the run has: the client knows
        lines = bytes(body).splitlines()
        assert bytes(body).endswith(b"\n") and 0 < len(lines) < len(expected)
        failed = [r for r in caplog.records if r.getMessage() == "evidence read failed part way"]
        assert len(failed) == 1 and getattr(failed[0], "run_id", None) == run_id
    finally:
        await admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await admin.close()
