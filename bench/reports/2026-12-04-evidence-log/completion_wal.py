"""WAL written per completed item, and the evidence log's bytes per entry.

Run from the root of the tree to measure (its `service`, `bench` and `migrations` are
used):

    cd /tmp/sweeper-before && python /path/to/completion_wal.py --database-url URL
    cd /tmp/sweeper-after && python /path/to/completion_wal.py --database-url URL

A fresh database is migrated to the tree's head and seeded as the drain benchmark seeds
(bench.drain.seed); then, until nothing is left, one admission leases up to --per-scope
items of each scope and one completion commits them all `succeeded` (the production
statements, claims.admit and claims.complete), each completion in a transaction whose WAL
records are read back from pg_walinspect by its transaction id: exact, whatever else the
shared server writes. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

sys.path.insert(0, os.getcwd())  # the tree measured, not this file's

from sqlalchemy import text

from bench.common import fresh_database
from bench.drain import POLICY, bench_policies, seed
from service import claims


async def measure(server_url: str, items: int, per_scope: int) -> dict[str, Any]:
    async with fresh_database(server_url, "wal") as db:
        engine = db.engine
        policy = bench_policies("http://127.0.0.1:9", 10).policies[POLICY]
        await seed(engine, policy, items)
        async with engine.begin() as conn:
            await conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
            await conn.execute(text("CHECKPOINT"))
            scopes = [r[0] for r in await conn.execute(text(
                "SELECT DISTINCT scope FROM items ORDER BY 1"))]
        walls: list[float] = []
        total = {"items": 0, "completions": 0, "wal_records": 0, "wal_bytes": 0,
                 "fpi_bytes": 0}
        while True:
            admission = await claims.admit(engine, owner="wal", wants=dict.fromkeys(
                scopes, per_scope), lease_seconds={POLICY: 300})
            if not admission.leases:
                break
            now = datetime.now(UTC)
            batch = [claims.Completion(lease, "wal", "succeeded", "succeeded", "http_204", 204,
                                       None, 0.0, False, now, now, 1.0)
                     for lease in admission.leases]
            async with engine.connect() as conn:
                start = (await conn.execute(text(
                    "SELECT pg_current_wal_insert_lsn()::text"))).scalar_one()
                xid = (await conn.execute(text(
                    "SELECT txid_current() % 4294967296"))).scalar_one()
                started = time.perf_counter()
                fenced = await claims.complete(conn, batch)  # commits this transaction
                walls.append((time.perf_counter() - started) / len(batch))
                assert not fenced
                # the commit was flushed: everything of this transaction is before this
                end = (await conn.execute(text(
                    "SELECT pg_current_wal_flush_lsn()::text"))).scalar_one()
                wal = (await conn.execute(text(
                    "SELECT count(*), coalesce(sum(record_length), 0),"
                    " coalesce(sum(fpi_length), 0)"
                    " FROM pg_get_wal_records_info(CAST(CAST(:a AS text) AS pg_lsn),"
                    " CAST(CAST(:b AS text) AS pg_lsn))"
                    " WHERE xid::text::bigint = CAST(:x AS bigint)"),
                    {"a": start, "b": end, "x": int(xid)})).one()
                await conn.commit()
            total["items"] += len(batch)
            total["completions"] += 1
            total["wal_records"] += int(wal[0])
            total["wal_bytes"] += int(wal[1])
            total["fpi_bytes"] += int(wal[2])
        sizes: dict[str, Any] = {}
        async with engine.connect() as conn:
            for table in ("evidence_log", "attempts"):
                found = (await conn.execute(text(
                    "SELECT to_regclass(:t) IS NOT NULL"), {"t": table})).scalar_one()
                if not found:
                    continue
                row = (await conn.execute(text(
                    "SELECT (SELECT count(*) FROM " + table + ") AS n,"
                    " pg_relation_size(CAST(:t AS regclass)) AS heap,"
                    " pg_indexes_size(CAST(:t AS regclass)) AS indexes,"
                    " pg_total_relation_size(CAST(:t AS regclass)) AS total,"
                    " (SELECT avg(pg_column_size(x.*)) FROM " + table + " x) AS avg_tuple"),
                    {"t": table})).one()
                n = max(int(row.n), 1)
                # per deletion: the log's rows are segments (one per completion)
                per = total["items"] if table == "evidence_log" else n
                sizes[table] = {"rows": int(row.n), "per": "deletion" if table ==
                                "evidence_log" else "row",
                                "heap_bytes_per": round(row.heap / per, 1),
                                "index_bytes_per": round(row.indexes / per, 1),
                                "total_bytes_per": round(row.total / per, 1),
                                "avg_tuple_bytes_in_heap": round(float(row.avg_tuple), 1)}
        items_done = max(total["items"], 1)
        return {"items": total["items"], "completions": total["completions"],
                "wal_bytes_per_item": round(total["wal_bytes"] / items_done, 1),
                "wal_bytes_per_item_without_fpi": round(
                    (total["wal_bytes"] - total["fpi_bytes"]) / items_done, 1),
                "wal_records_per_item": round(total["wal_records"] / items_done, 2),
                "completion_wall_us_per_item_median": round(
                    statistics.median(walls) * 1e6, 1) if walls else None,
                "sizes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--per-scope", type=int, default=64,
                        help="items leased per scope per admission (4 scopes)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.database_url, args.items, args.per_scope)),
                     indent=2))


if __name__ == "__main__":
    main()
