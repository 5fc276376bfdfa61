"""What one item costs the database, and what each guarantee adds to it.

The drain's database CPU per item (`bench drain`, `bench peers`) mixes the worker's and the
server's share of two cores, and moves with the machine's load. This benchmark runs only
the two statements every item goes through, the ones that run on the database whatever the
upstream: the admission (`claims.admit`: tokens taken, items leased) and the fenced
completion (`completions.complete`: the outcome recorded, the deletion appended to the
evidence log), as the worker sends them, from one connection, one statement after the
other, with no upstream and nothing else running. What it reports per item: the backend's
CPU (from /proc; its one backend is the only one), split by statement; and bench/counts.py's
counts (WAL bytes, rows written, statements, buffers dirtied), which do not drift. What
comes before the drain is counted the same way, each in its own window: the registration
(bulk, 10,000 items a statement) and the run's publication that releases the items.

Each **variant** takes one guarantee's cost away, on a database of its own, so the
difference from `shipped` is what that guarantee costs in µs and bytes:

  shipped              the schema and statements as they are
  no-evidence          the completion without its evidence CTEs (deleted .. moved): no
                       record of the deletion (never acceptable; the cost of the proof)
  no-operator-indexes  without the seven indexes only operators, runs and retention read
                       (items_batch_cover, _finished, _listed, _dead, _skipped, _held,
                       _unreleased): every write maintains them, no claim reads them
  no-progress-index    without items_batch_cover alone (a run's progress by status)
  no-retention-index   without items_finished alone (retention's walk of finished items)
  no-listing-index     without items_listed alone (operators' pages of pending items)
  no-identity-checks   without the CHECKs on tenant_id, object_id, scope, policy and
                       operation_key (evaluated on every update of the row, though only
                       an insert can change those columns)
  fillfactor-80        items' pages a fifth empty, as before migration 0027 (shipped: 60):
                       fewer of an admission's claims find room for a HOT update
  fillfactor-50        items' pages half empty

`--round` sweeps the items an admission claims (the worker's rounds claim at most 64):
with two sizes the report fits each statement's cost to fixed + per-item.

    python -m bench itemcost --items 20000 --repeat 3
    python -m bench itemcost --variants shipped --round 16,64,256
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from bench import counts
from bench.common import (
    BenchContext,
    Benchmark,
    FreshDatabase,
    backend_cpu,
    cpu_seconds,
    cpu_spent,
    fresh_database,
    int_list,
    patched,
    progress,
    summarize,
    vacuum_analyze,
)
from bench.drain import (
    MOCK_BASE_URL,
    POLICY,
    TENANTS,
    bench_policies,
    register_items,
    release_due,
)
from service.config.policies import Policy
from service.db.statements import Statement
from service.ledger import claims, completions

FLUSH: Final = 256  # completions per statement (the worker flushes what finished, up to 1,000)
OWNER: Final = "bench-itemcost"
R = TypeVar("R")

_OPERATOR_INDEXES = ("items_batch_cover", "items_finished", "items_listed", "items_dead",
                     "items_skipped", "items_held", "items_unreleased")
_IDENTITY_CHECKS = ("items_tenant_id_check", "items_object_id_check", "items_scope_check",
                    "items_policy_check", "items_operation_key_check")


def _without_evidence(statement: Statement) -> Statement:
    """The completion with its evidence CTEs cut out (the update and the attempt rows
    stay). Fails loudly if the statement no longer has the shape this cuts."""
    sql = statement.sql
    start, end = sql.find("    ),\n    deleted AS ("), sql.find("    INSERT INTO attempts")
    if start < 0 or end < start:
        raise RuntimeError("completions.complete changed shape: update bench/itemcost.py")
    return Statement(statement.name, statement.summary, sql[:start] + "    )\n" + sql[end:])


# variant -> (SQL run after migrating, statement patches)
VARIANTS: Final[dict[str, tuple[tuple[str, ...], bool]]] = {
    "shipped": ((), False),
    "no-evidence": ((), True),
    "no-operator-indexes": ((f"DROP INDEX {', '.join(_OPERATOR_INDEXES)}",), False),
    "no-progress-index": (("DROP INDEX items_batch_cover",), False),
    "no-retention-index": (("DROP INDEX items_finished",), False),
    "no-listing-index": (("DROP INDEX items_listed",), False),
    "no-identity-checks": ((
        "ALTER TABLE items " + ", ".join(f"DROP CONSTRAINT {c}" for c in _IDENTITY_CHECKS),),
        False),
    "fillfactor-80": (("ALTER TABLE items SET (fillfactor = 80)",), False),
    "fillfactor-50": (("ALTER TABLE items SET (fillfactor = 50)",), False),
}


def _variant_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=20_000, help="items per measurement")
    parser.add_argument("--round", type=int_list, default=[64],
                        help="items per admission, comma-separated (default 64, the "
                             "worker's largest round)")
    parser.add_argument("--variants", type=_variant_list, default=list(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")


@contextmanager
def _statements(variant: str) -> Iterator[None]:
    if VARIANTS[variant][1]:
        with patched(completions, "_COMPLETE", _without_evidence(completions._COMPLETE)):
            yield
    else:
        yield


class _Cpu:
    """The backend's CPU seconds, added up per statement kind."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.spent = {"admit": 0.0, "complete": 0.0}

    @contextmanager
    def measuring(self, kind: str) -> Iterator[None]:
        before = cpu_seconds(self.pid)
        yield
        self.spent[kind] += cpu_seconds(self.pid) - before


async def _drain(conn: AsyncConnection, policy: Policy, items: int, per_round: int
                 ) -> tuple[dict[str, float], int, int]:
    """Admit and complete (as succeeded) every item; (CPU by kind, admissions,
    completions)."""
    pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
    cpu = _Cpu(pid)
    scopes = [f"tenant:{t}" for t in TENANTS]
    share = max(1, per_round // len(scopes))
    done = admissions = flushes = 0
    pending: list[completions.Completion] = []
    while done < items:
        with cpu.measuring("admit"):
            admitted = await claims.admit(
                conn, owner=OWNER, wants=dict.fromkeys(scopes, share),
                lease_seconds={policy.name: policy.config.lease_seconds},
                max_attempts={policy.name: policy.config.max_attempts})
        admissions += 1
        now = datetime.now(UTC)
        pending += [completions.Completion(
            lease, OWNER, "succeeded", "succeeded", "deleted", 204, None, 0.0, False, now, now,
            1.0) for lease in admitted.leases]
        if len(pending) >= FLUSH or (pending and not admitted.leases):
            batch, pending = pending, []
            with cpu.measuring("complete"):
                fenced = await completions.complete(conn, batch)
            if fenced:
                raise RuntimeError(f"{len(fenced)} completions fenced: nothing else runs")
            done += len(batch)
            flushes += 1
        elif not admitted.leases:
            raise RuntimeError(f"nothing left to admit after {done} of {items} items")
    return cpu.spent, admissions, flushes


async def measure(ctx: BenchContext, variant: str, items: int, per_round: int
                  ) -> dict[str, Any]:
    """One variant at one round size, on a fresh database."""
    async with fresh_database(ctx.server_url, "itemcost") as db:
        for sql in VARIANTS[variant][0]:
            async with db.engine.begin() as c:
                await c.execute(text(sql))
        policies = bench_policies(MOCK_BASE_URL, 100)
        policy = policies.policies[POLICY]
        before = await _stages(ctx, db, policy, items)

        async def drained() -> tuple[dict[str, float], int, int]:
            with _statements(variant):
                async with db.engine.connect() as conn:
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                    return await _drain(conn, policy, items, per_round)

        (spent, admissions, flushes), counted = await _counted(ctx, db, items, drained)
        async with db.engine.connect() as conn:
            succeeded = (await conn.execute(text(
                "SELECT count(*) FROM items WHERE status = 'succeeded'"))).scalar_one()
            segments = (await conn.execute(text("SELECT count(*) FROM evidence_log"))
                        ).scalar_one()
            heap = (await conn.execute(text("SELECT pg_relation_size('items')"))).scalar_one()
        await db.engine.dispose()
    if succeeded != items:
        raise RuntimeError(f"{variant}: {succeeded} of {items} items succeeded")
    return {"variant": variant, "round": per_round, "items": items, **before,
            "admissions": admissions, "completions_statements": flushes,
            "evidence_segments": segments,
            "items_heap_bytes_per_item": round(heap / items),
            "db_us_per_item": {k: round(v / items * 1e6, 2) for k, v in spent.items()}
            | {"total": round(sum(spent.values()) / items * 1e6, 2)},
            "db_us_per_statement": {
                "admit": round(spent["admit"] / admissions * 1e6, 1),
                "complete": round(spent["complete"] / flushes * 1e6, 1)},
            "counts": counted}


async def _counted(ctx: BenchContext, db: FreshDatabase, items: int,
                   step: Callable[[], Awaitable[R]]) -> tuple[R, dict[str, Any]]:
    """`step` (on db.engine) inside a counts window: what it returned, and the counts."""
    await db.engine.dispose()
    window = counts.Window(ctx.server_url, db.url, "items")
    await window.open()
    result = await step()
    await db.engine.dispose()
    return result, await window.close(items)


async def _stages(ctx: BenchContext, db: FreshDatabase, policy: Policy, items: int
                  ) -> dict[str, Any]:
    """What comes before the drain, each counted with its backends' CPU: the items
    registered (bulk, as `POST /v1/items` or a store's walk registers them), then released
    by one run's publication (batches of 500); then VACUUM (ANALYZE), outside any window."""

    async def cpu_of(step: Awaitable[object]) -> float | None:
        async with db.engine.connect() as conn:  # its backend exists before the reading
            await conn.execute(text("SELECT 1"))
        before = await backend_cpu(db.url, db.name)
        await step
        spent = cpu_spent(before, await backend_cpu(db.url, db.name))
        return None if spent is None else round(spent / items * 1e6, 2)

    registered = await _counted(
        ctx, db, items, lambda: cpu_of(register_items(db.engine, policy, items)))
    published = await _counted(ctx, db, items, lambda: cpu_of(release_due(db.engine)))
    await vacuum_analyze(db.engine, "items")
    await db.engine.dispose()
    return {stage: {"db_us_per_item": spent, "counts": counted}
            for stage, (spent, counted) in (("registration", registered),
                                            ("publication", published))}


def _cell(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def series(part: str, key: str) -> dict[str, float | None]:
        return summarize([r[part][key] for r in reps])

    return {
        "db_us_per_item": {k: series("db_us_per_item", k)
                           for k in ("admit", "complete", "total")},
        "db_us_per_statement": {k: series("db_us_per_statement", k)
                                for k in ("admit", "complete")},
        "counts": counts.summarize_counts([r["counts"] for r in reps]),
        **{stage: {"db_us_per_item": summarize([r[stage]["db_us_per_item"] for r in reps
                                                if r[stage]["db_us_per_item"] is not None]),
                   "counts": counts.summarize_counts([r[stage]["counts"] for r in reps])}
           for stage in ("registration", "publication")},
        "repetitions": list(reps)}


def _fit(cells: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Each statement's CPU as fixed per statement + per item, from the smallest and the
    largest round (medians)."""
    if len(cells) < 2:
        return None
    lo, hi = min(cells), max(cells)

    def per_statement(size: int, kind: str) -> tuple[float, float]:
        reps = cells[size]["repetitions"]
        per = statistics.median(r["db_us_per_statement"][kind] for r in reps)
        rows = statistics.median(r["items"] / r["admissions"] for r in reps)
        return per, rows

    (a_lo, n_lo), (a_hi, n_hi) = per_statement(lo, "admit"), per_statement(hi, "admit")
    per_item = (a_hi - a_lo) / (n_hi - n_lo) if n_hi != n_lo else None
    return {"admit_us_per_item": None if per_item is None else round(per_item, 1),
            "admit_us_per_statement": None if per_item is None
            else round(a_lo - per_item * n_lo, 1),
            "from_rounds": [lo, hi]}


async def run(ctx: BenchContext, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[int, list[dict[str, Any]]]] = {
        v: {r: [] for r in args.round} for v in args.variants}
    for rep in range(args.repeat):
        order = list(args.variants) if rep % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            for per_round in args.round:
                doc = await measure(ctx, variant, args.items, per_round)
                results[variant][per_round].append(doc)
                c = doc["db_us_per_item"]
                progress(f"rep {rep + 1}/{args.repeat}: {variant:20s} round {per_round:4d}  "
                         f"db {c['total']:.1f} us/item (admit {c['admit']:.1f}, complete "
                         f"{c['complete']:.1f}), WAL "
                         f"{doc['counts']['per_item']['wal_bytes']:.0f} B/item")
    cells = {v: {r: _cell(reps) for r, reps in by_round.items()}
             for v, by_round in results.items()}
    out: dict[str, Any] = {"items": args.items, "repeat": args.repeat, "flush": FLUSH,
                           "variants": cells, "fit": {v: _fit(c) for v, c in cells.items()},
                           "guarantee_costs": _differences(cells)}
    _print(out)
    return out


def _differences(cells: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Each variant's medians less shipped's, at each round both ran: what the guarantee
    the variant drops costs (positive: the guarantee costs that much)."""
    shipped = cells.get("shipped")
    if shipped is None:
        return {}
    out: dict[str, Any] = {}
    for variant, by_round in cells.items():
        if variant == "shipped":
            continue
        for size, cell in by_round.items():
            base = shipped.get(size)
            if base is None:
                continue
            cpu = base["db_us_per_item"]["total"]["median"]
            wal = (base["counts"].get("wal_bytes") or {}).get("median")
            mine_cpu = cell["db_us_per_item"]["total"]["median"]
            mine_wal = (cell["counts"].get("wal_bytes") or {}).get("median")
            out.setdefault(variant, {})[size] = {
                "db_us_per_item": None if cpu is None or mine_cpu is None
                else round(cpu - mine_cpu, 2),
                "wal_bytes_per_item": None if wal is None or mine_wal is None
                else round(wal - mine_wal, 1)}
    return out


def _print(doc: dict[str, Any]) -> None:
    lines = ["itemcost: database CPU per item, median (min-max), and counts per item"]
    for variant, by_round in doc["variants"].items():
        for size, cell in by_round.items():
            t = cell["db_us_per_item"]
            lines.append(
                f"  {variant:20s} round {size:4d}: {t['total']['median']} us "
                f"({t['total']['min']}-{t['total']['max']}; admit {t['admit']['median']}, "
                f"complete {t['complete']['median']})")
            lines.append("      " + counts.summary_line(cell["counts"]))
            for stage in ("registration", "publication"):
                lines.append(f"      before it, {stage}: {cell[stage]['db_us_per_item']['median']}"
                             f" us; {counts.summary_line(cell[stage]['counts'])}")
    for variant, fit in doc["fit"].items():
        if fit:
            lines.append(f"  {variant}: admission = {fit['admit_us_per_statement']} us per "
                         f"statement + {fit['admit_us_per_item']} us per item")
    for variant, by_round in doc["guarantee_costs"].items():
        for size, d in by_round.items():
            lines.append(f"  shipped - {variant} (round {size}): {d['db_us_per_item']} us, "
                         f"{d['wal_bytes_per_item']} B of WAL per item")
    progress("\n".join(lines))


BENCHMARK = Benchmark(name="itemcost",
                      help="the database's CPU and writes per item, and each guarantee's share",
                      add_arguments=add_arguments, run=run)
