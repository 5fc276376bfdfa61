"""A run's report: its candidates counted per policy when publication starts, what discovery
found per source, and, for a report-only run, the comparison with the previous one."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.ext.asyncio import AsyncConnection

from service.db.statements import Statement
from service.db.statements import run as run_statement

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# A candidate of a run: an item the run's cutoff (and its optional policy and tenant)
# selects that no batch has released yet. Its first terms are items_unreleased's WHERE; the
# figures, the chunks and the remainder all count exactly this set.
CANDIDATE: Final = """status = 'pending' AND released_at IS NULL AND due_at <= :cutoff
      AND (CAST(:policy AS text) IS NULL OR policy = :policy)
      AND (CAST(:tenant AS text) IS NULL OR tenant_id = :tenant)"""


# Record the candidate figures for the run's exact predicate, per policy (dry runs report
# only these; `held`: candidates a legal hold keeps, which a run releases but no worker
# calls until the hold ends), in SQL: no due_at passes through Python, so publication does
# not depend on items_due_at_range keeping due_at where Python's datetime reaches (asyncpg
# cannot decode a year BC). The report renders each figure as the database does (ISO 8601
# under SET LOCAL TIME ZONE 'UTC'), exactly whatever the value; the typed columns, which
# every reader of the run row decodes, are raised to 0001-01-01, Python's earliest instant
# (per row: no candidates still leaves them NULL). Candidates are due by the run's cutoff,
# which Python holds (runs_cutoff_range), so no upper bound is needed.
_RECORD_CANDIDATES = Statement("reports.record_candidates", (
    "Count the run's candidates per policy, with their oldest and newest due_at, onto the "
    "run row and its report."), f"""
    WITH per_policy AS (
        SELECT policy, count(*) AS n, min(due_at) AS oldest, max(due_at) AS newest,
               count(*) FILTER (WHERE hold_id IS NOT NULL) AS held
        FROM items
        WHERE {CANDIDATE}
        GROUP BY policy
    )
    UPDATE runs SET
        candidates = (SELECT coalesce(sum(n), 0) FROM per_policy),
        oldest_due_at = (SELECT min(greatest(oldest, '0001-01-01 00:00:00+00'))
                         FROM per_policy),
        newest_due_at = (SELECT max(greatest(newest, '0001-01-01 00:00:00+00'))
                         FROM per_policy),
        report = jsonb_build_object('policies', (
            SELECT coalesce(jsonb_object_agg(policy, jsonb_build_object(
                       'candidates', n, 'oldest_due_at', oldest, 'newest_due_at', newest,
                       'held', held)),
                   '{{}}')
            FROM per_policy))
    WHERE id = :id
    RETURNING candidates
""")  # noqa: S608 - only a constant fragment is interpolated


def candidate_params(run: Any) -> dict[str, Any]:
    return {"cutoff": run["cutoff"], "policy": run["policy"], "tenant": run["tenant_id"]}


_REPORT_IN_UTC = Statement("reports.report_in_utc", (
    "Render the report's due_at figures in UTC for the rest of this transaction."),
    "SET LOCAL TIME ZONE 'UTC'")


_PREVIOUS_DRY_RUN = Statement("reports.previous_dry_run", (
    "The latest published dry run before this one with the same policy and tenant, to "
    "report the change in candidates."),
    "SELECT id, candidates FROM runs WHERE dry_run AND state = 'published' "
    "AND id < :id AND policy IS NOT DISTINCT FROM :policy "
    "AND tenant_id IS NOT DISTINCT FROM :tenant ORDER BY id DESC LIMIT 1")


async def previous_dry_run(conn: AsyncConnection, run_id: int, policy: str | None,
                           tenant: str | None) -> Any:
    """The latest published dry run before `run_id` over the same policy and tenant (its id
    and candidates), or None: what a report-only run is compared with."""
    return (await run_statement(conn, _PREVIOUS_DRY_RUN, {
        "id": run_id, "policy": policy, "tenant": tenant})).first()


_REPORT_COMPARISON = Statement("reports.report_comparison", (
    "Add the comparison with the previous dry run (or null) to a dry run's report."),
    "UPDATE runs SET report = report || jsonb_build_object("
    "'previous_dry_run', CAST(:comparison AS jsonb)) WHERE id = :id")


# A run with store sources: each discovered policy's figures join its report, `source`
# saying what discovery read. A report-only run registered nothing, so the discovered
# figures are its candidates for those policies (the ledger's would count only what an
# earlier run left behind); a real run's stay the ledger's, which hold what it registered.
_DISCOVERED_FIGURES = Statement("reports.discovered_figures", (
    "Add what discovery found per source policy to the run's report (for a report-only "
    "run, as its candidates) and total the run's figures again."), """
    WITH d AS (
        SELECT policy, candidates, oldest_age, newest_age,
               jsonb_build_object('pages', pages, 'candidates', candidates,
                                  'registered', registered, 'errors', errors,
                                  'error_samples', error_samples) AS source
        FROM discoveries WHERE run_id = :id
    ),
    merged AS (
        SELECT coalesce(r.report -> 'policies', '{}') || coalesce(jsonb_object_agg(d.policy,
                   CASE WHEN r.dry_run
                        THEN jsonb_build_object('candidates', d.candidates,
                                                'oldest_due_at', d.oldest_age,
                                                'newest_due_at', d.newest_age, 'held', 0)
                        ELSE coalesce(r.report -> 'policies' -> d.policy, jsonb_build_object(
                                 'candidates', 0, 'oldest_due_at', NULL,
                                 'newest_due_at', NULL, 'held', 0)) END
                   || jsonb_build_object('source', d.source)), '{}') AS policies
        FROM runs r LEFT JOIN d ON true
        WHERE r.id = :id
        GROUP BY r.id, r.report
    )
    UPDATE runs SET
        report = jsonb_set(report, '{policies}', merged.policies),
        candidates = (SELECT coalesce(sum(CAST(v ->> 'candidates' AS bigint)), 0)
                      FROM jsonb_each(merged.policies) AS e(k, v)),
        oldest_due_at = (SELECT min(CAST(v ->> 'oldest_due_at' AS timestamptz))
                         FROM jsonb_each(merged.policies) AS e(k, v)),
        newest_due_at = (SELECT max(CAST(v ->> 'newest_due_at' AS timestamptz))
                         FROM jsonb_each(merged.policies) AS e(k, v))
    FROM merged WHERE id = :id
    RETURNING candidates
""")


async def record_candidates(conn: AsyncConnection, run: Any, discovered: bool = False
                            ) -> None:
    """Count the run's candidates into its report (with discovery's figures when it
    discovered), and compare a report-only run with the previous one."""
    await run_statement(conn, _REPORT_IN_UTC)  # the report's rendering of due_at
    params = {**candidate_params(run), "id": run["id"]}
    total = (await run_statement(conn, _RECORD_CANDIDATES, params)).scalar_one()
    if discovered:
        total = (await run_statement(conn, _DISCOVERED_FIGURES, {"id": run["id"]})
                 ).scalar_one()
    if run["dry_run"]:
        previous = await previous_dry_run(conn, run["id"], run["policy"], run["tenant_id"])
        comparison = ({"run_id": previous.id, "candidates": previous.candidates,
                       "difference": total - previous.candidates} if previous else None)
        await run_statement(conn, _REPORT_COMPARISON,
                            {"comparison": json.dumps(comparison), "id": run["id"]})
