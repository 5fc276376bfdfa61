"""What start-up asks each store of the policies' statements (`sweeper check-config`,
`sweeper serve`): a source query's columns and plan (read-only: a plan that writes or locks
rows is refused), a target statement's result columns (run on no ids in a transaction
rolled back), and each with its plan when asked. A store out of reach is a warning, not a
problem: its scopes pause when they need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from service.config.policies import Policies
from service.config.policy_file import SourceConfig, TargetConfig
from service.db.engine import sqlstate
from service.db.statements import run
from service.sweeps.store_databases import (
    EARLIEST,
    SOURCE_COLUMNS,
    StoreError,
    Stores,
    columns_statement,
    describe,
    explain_statement,
    limit_transaction,
    page_statement,
    read_only,
    target_statement,
)

_WRITING_NODES: Final = frozenset({"ModifyTable", "LockRows"})


def _plan_nodes(plan: Any) -> set[str]:
    nodes = {str(plan.get("Node Type"))}
    for child in plan.get("Plans", []):
        nodes |= _plan_nodes(child)
    return nodes


async def check_source(stores: Stores, key: str, source: SourceConfig, *,
                       explain: bool = False) -> tuple[list[str], str | None]:
    """(problems, plan): the source query's columns and plan as the store sees them. A
    query whose plan writes or locks rows is refused; one missing a column too. StoreError
    when the store cannot be reached."""
    page = page_statement(source, after=True, tenant=False)
    params = {"cutoff": EARLIEST, "page_rows": 1, "after_age": EARLIEST, "after_tenant": "",
              "after_object": ""}
    # the plan shown is the one a run now would get (EXPLAIN plans, it does not run)
    planned = {"cutoff": datetime.now(UTC)}
    conn = await stores.connect(source.store)
    try:
        async with conn.begin():
            await read_only(conn, statement_ms=source.statement_timeout_ms)
            columns = list((await run(conn, columns_statement(source),
                                      {"cutoff": EARLIEST})).keys())
            missing = [c for c in SOURCE_COLUMNS if c not in columns]
            if missing:
                return [f"{key}.query: must return the columns {', '.join(SOURCE_COLUMNS)}; "
                        f"missing {', '.join(missing)} (it returns "
                        f"{', '.join(columns) or 'none'})"], None
            document = (await run(conn, explain_statement(page, as_json=True), params)
                        ).scalar_one()
            plan = document if isinstance(document, list) else json.loads(document)
            writes = _plan_nodes(plan[0]["Plan"]) & _WRITING_NODES
            problems = [f"{key}.query: must be read-only; its plan has "
                        f"{' and '.join(sorted(writes))}"] if writes else []
            shown = "\n".join(r[0] for r in (await run(
                conn, explain_statement(page, as_json=False), {**params, **planned})).all()) \
                if explain \
                else None
            return problems, shown
    except Exception as exc:
        if sqlstate(exc) == "25006":  # it would write or lock: refused in READ ONLY
            return [f"{key}.query: must be read-only; the store refused it in a read-only "
                    f"transaction: {describe(exc)}"], None
        return [f"{key}.query: the store refused it: {describe(exc)}"], None
    finally:
        await conn.close()


async def check_target(stores: Stores, key: str, target: TargetConfig, *,
                       explain: bool = False) -> tuple[list[str], str | None]:
    """(problems, plan) of a target statement: it is run with no object ids and the
    earliest cutoff Python holds, in a transaction that is rolled back, so it matches no
    row, and must return a column `object_id`. StoreError when the store cannot be
    reached."""
    statement = target_statement(target)
    params: dict[str, Any] = {"object_ids": [], "cutoff": EARLIEST}
    planned = {"cutoff": datetime.now(UTC)}  # the plan shown: a run's now (only planned)
    conn = await stores.connect(target.store)
    try:
        transaction = await conn.begin()
        try:
            await limit_transaction(conn, statement_ms=target.statement_timeout_ms,
                                    lock_ms=target.lock_timeout_ms)
            columns = list((await run(conn, statement, params)).keys())
            problems = [] if "object_id" in columns else [
                f"{key}.statement: must return the column object_id (RETURNING ... AS "
                f"object_id); it returns {', '.join(columns) or 'none'}"]
            shown = "\n".join(r[0] for r in (await run(
                conn, explain_statement(statement, as_json=False), {**params, **planned})
                ).all()) \
                if explain else None
            return problems, shown
        finally:
            await transaction.rollback()
    except Exception as exc:
        return [f"{key}.statement: the store refused it: {describe(exc)}"], None
    finally:
        await conn.close()


@dataclass(frozen=True)
class StoreCheck:
    """What start-up found of the policies' store statements: problems (each names its
    key; the process refuses to start), warnings (a store out of reach: its scopes pause
    when they need it), and each statement with its plan when asked."""

    problems: list[str]
    warnings: list[str]
    statements: list[str]


async def check_policies(policies: Policies, *, explain: bool = False) -> StoreCheck:
    """Ask each store what it makes of the source queries and target statements."""
    stores = Stores(policies.stores)
    check = StoreCheck([], [], [])
    unreachable: set[str] = set()
    try:
        for name, policy in sorted(policies.policies.items()):
            source, target = policy.store_source, policy.config.target
            parts: list[tuple[str, str, str]] = []
            if source is not None:
                parts.append(("source", source.store,
                              page_statement(source, after=True, tenant=False).sql))
            if target is not None:
                parts.append(("target", target.store, target_statement(target).sql))
            for part, store, sql in parts:
                if store in unreachable:
                    continue
                key = f"policies.{name}.{part}"
                try:
                    if part == "source" and source is not None:
                        found, plan = await check_source(stores, key, source, explain=explain)
                    elif target is not None:
                        found, plan = await check_target(stores, key, target, explain=explain)
                except StoreError as exc:
                    unreachable.add(store)
                    check.warnings.append(
                        f"policies file {policies.source}: stores.{store}: cannot be reached "
                        f"({exc.failure.value}: {exc.detail}); its statements were not "
                        "checked, and its scopes pause until it answers")
                    continue
                check.problems.extend(f"policies file {policies.source}: {p}" for p in found)
                check.statements.append(
                    f"{key} on store {store!r}:\n  {sql}"
                    + ("\n  plan:\n    " + plan.replace("\n", "\n    ") if plan else ""))
    finally:
        await stores.aclose()
    return check
