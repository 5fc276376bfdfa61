"""The statement convention (service/db/statements.py): every statement the service runs is a
named `Statement` run through that module (`fetch`, `fetch_none`, `run`), and the shared
predicates appear in them only as the one fragment each, never as a copy.

Two rules read the source of every module under service/ (no import runs), so a module that
starts running SQL of its own fails here whether or not it is listed below: no `text(...)`
and no driver call (`.execute`, `.fetchrow`, ...) except, in the modules on a plain asyncpg
connection, one that sends a named statement's `.text`."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType

import pytest

from service.budget import buckets, scope_controls
from service.cluster import leader, retention
from service.config.policy_file import GuardConfig
from service.credentials import tenant_credentials
from service.db import embedded, migrate, statements, wakeups
from service.db.statements import (
    CLOSURE_OVER,
    OPEN_SCOPE,
    Statement,
    expired_lease,
    ready_item,
)
from service.evidence import audit_trail, chain, object_deletions
from service.execution import outbox, sorting
from service.history import minutes
from service.http.api import health
from service.http.console import sessions
from service.ledger import (
    claims,
    completions,
    gauges,
    hold_acks,
    hold_marking,
    holds,
    item_selection,
    operator_reads,
    region_pins,
    registration,
    tenant_spellings,
)
from service.runs import discovery, progress, publication, reports, trigger
from service.sweeps import list_pages, store_databases, store_targets
from service.webhooks import intake, receipts
from tests.conftest import REPO_ROOT
from tests.fakes.store_schema import store_policies

# Every module that runs SQL, each with its statements as module-level constants.
MODULES = (claims, completions, buckets, gauges, scope_controls, publication, registration,
           retention, audit_trail, health, migrate, embedded, tenant_credentials, holds,
           object_deletions, chain, discovery, store_databases, store_targets, list_pages,
           operator_reads, sessions, statements, tenant_spellings, leader, progress, reports,
           trigger, wakeups, hold_acks, hold_marking, item_selection, receipts, minutes,
           outbox, sorting, region_pins)
# Statements on a plain asyncpg connection, sent as `statement.text` (`$n` parameters):
# webhook intake's receipts and wake-up (its own pool, one round trip per delivery) and
# the embedded server's bootstrap (its admin database, before Sweeper's exists).
ASYNCPG_MODULES = (intake, receipts, embedded)
# Statements built by a function, because their text holds what no parameter can carry;
# each built here with the value the service passes.
_SHOP = store_policies("postgresql://store.invalid/shop").policies["expired-carts"].config
assert _SHOP.source is not None and _SHOP.target is not None and _SHOP.guard is None
_GUARD = GuardConfig(store="shop", active_backends=True, max=20)
BUILT = {"service/db/embedded.py": {"_create_database": embedded._create_database(
    embedded.DATABASE_NAME)},
    # the minutes' upserts and their pruning: one per table, its name in the text
    "service/history/minutes.py": {"_adding": minutes._ADD_POLICIES},
    "service/cluster/retention.py": {"_prune_minutes": retention._PRUNE_MINUTES[0]},
    # a store's statements hold the policy's own SQL and its ledger table's name
    "service/sweeps/store_databases.py": {
        "page_statement": store_databases.page_statement(_SHOP.source, after=True, tenant=True),
        "columns_statement": store_databases.columns_statement(_SHOP.source),
        "explain_statement": store_databases.explain_statement(
            store_databases.page_statement(_SHOP.source, after=False, tenant=False), as_json=True),
        "guard_statement": store_databases.guard_statement(_GUARD),
        "target_statement": store_databases.target_statement(_SHOP.target)},
    "service/sweeps/store_targets.py": {
        name: getattr(store_targets, name)("cleanup_ledger")
        for name in ("ledger_create", "ledger_index", "ledger_prune", "ledger_insert",
                     "ledger_done", "ledger_earlier", "ledger_record")}}

# Modules allowed to call the driver directly, and why.
EXEMPT = {
    # the one place statements are run
    "service/db/statements.py",
    # the worker's LISTEN connection probes itself with `SELECT 1` (a liveness check of the
    # connection, no statement of the ledger); the worker package is not held to this yet
    "service/worker/postgres.py",
}

# Methods that send SQL, on a SQLAlchemy connection or engine or on an asyncpg connection or
# pool (called with the SQL first; `result.scalar()` takes none and is no such call).
DRIVER_CALLS = frozenset({
    "execute", "executemany", "exec_driver_sql", "scalar", "scalars", "stream",
    "stream_scalars", "fetch", "fetchrow", "fetchval", "prepare", "cursor",
    "copy_from_query", "copy_from_table", "copy_to_table", "copy_records_to_table"})


def statements_of(module: ModuleType) -> list[Statement]:
    """The statements `module` defines (not those it imports from their owner)."""
    defined, _ = statement_names(parse(Path(str(module.__file__))))
    constants = [v for k, v in vars(module).items() if isinstance(v, Statement) and k in defined]
    return constants + list(BUILT.get(relative(module), {}).values())


def relative(module: ModuleType) -> str:
    return Path(str(module.__file__)).resolve().relative_to(REPO_ROOT).as_posix()



def service_sources() -> list[Path]:
    return sorted((REPO_ROOT / "service").rglob("*.py"))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def statement_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The module-level names bound to a `Statement(...)`, and the module's functions
    annotated to return one."""
    constants = {target.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                 and node.value.func.id == "Statement"
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Name)}
    builders = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                and isinstance(node.returns, ast.Name | ast.Constant)
                and (getattr(node.returns, "id", None) or getattr(node.returns, "value", None))
                == "Statement"}
    return constants, builders


ALL = [s for m in MODULES for s in statements_of(m)]


def raw_sql(path: Path, asyncpg: bool) -> list[str]:
    """Where `path` builds SQL with `text()` or sends SQL itself; in an asyncpg module a
    driver call is allowed when what it sends is a named statement's `.text` (its own, or
    one it imports from the service module that owns it)."""
    tree = parse(path)
    constants, builders = statement_names(tree)
    constants |= {alias.asname or alias.name for node in tree.body
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                      "service.") for alias in node.names if alias.name.isupper()}

    def named(arg: ast.expr) -> bool:
        if not (isinstance(arg, ast.Attribute) and arg.attr == "text"):
            return False
        of = arg.value
        return (isinstance(of, ast.Name) and of.id in constants) or (
            isinstance(of, ast.Call) and isinstance(of.func, ast.Name) and of.func.id in builders)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            found += [f"imports {a.name}" for a in node.names if a.name in ("text", "TextClause")]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Name) and func.id == "text") or (
                isinstance(func, ast.Attribute) and func.attr == "text"):
            found.append(f"line {node.lineno}: text(...)")
        elif isinstance(func, ast.Attribute) and func.attr in DRIVER_CALLS and node.args and \
                not (asyncpg and named(node.args[0])):
            found.append(f"line {node.lineno}: .{func.attr}(...)")
    return found


def test_every_statement_is_named_after_its_module_once() -> None:
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[-1]
        assert statements_of(module), short
        for s in statements_of(module):
            assert s.name.startswith(f"{short}."), s.name
    names = [s.name for s in ALL]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_module_with_statements_is_listed() -> None:
    """A module that defines statements is held to the naming rules above."""
    listed = {relative(m) for m in MODULES}
    defining = {path.relative_to(REPO_ROOT).as_posix() for path in service_sources()
                if any(statement_names(parse(path)))}
    assert defining - {"service/db/statements.py"} <= listed


def test_every_statement_builder_is_checked() -> None:
    """A function that builds a statement is listed in BUILT, so what it builds is checked
    like the constants."""
    for module in MODULES:
        _, builders = statement_names(parse(Path(str(module.__file__))))
        assert builders == set(BUILT.get(relative(module), {})), relative(module)


def test_a_statement_is_sent_with_its_name() -> None:
    assert claims._ADMIT.text.startswith("/* claims.admit */ WITH clock AS")
    assert publication._PICK.text.startswith(
        "/* publication.pick */ SELECT id, policy, policy_version FROM items\n")
    assert receipts._RECORD.text.startswith("/* receipts.record */ WITH existing AS (")


@pytest.mark.parametrize("statement", ALL, ids=lambda s: s.name)
def test_the_text_sent_is_the_sql_with_its_name_first(statement: Statement) -> None:
    """The name comment is all the convention adds: the SQL reaches the server as written
    (asyncpg's `$n` and `:name` parameters alike)."""
    assert statement.text == f"/* {statement.name} */ {statement.sql.strip()}"


@pytest.mark.parametrize(("name", "summary", "error"), [
    ("admit", "a summary", "is not module.what"), ("claims.admit", "", "one line"),
    ("claims.admit", "two\nlines", "one line")])
def test_a_statement_needs_a_dotted_name_and_a_one_line_summary(name: str, summary: str,
                                                                 error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Statement(name, summary, "SELECT 1")


@pytest.mark.parametrize("path", [p for p in service_sources()
                                  if p.relative_to(REPO_ROOT).as_posix() not in EXEMPT],
                         ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_statements_run_only_through_the_convention(path: Path) -> None:
    """No inline `text(...)` and no driver call of its own: every statement is a `Statement`
    run by fetch, fetch_none or run (or, on an asyncpg connection, sent as its `.text`)."""
    asyncpg = path.resolve() in {Path(str(m.__file__)).resolve() for m in ASYNCPG_MODULES}
    assert raw_sql(path, asyncpg) == []


@pytest.mark.parametrize(("source", "asyncpg", "found"), [
    ("from sqlalchemy import text\nQ = text('SELECT 1')\n", False,
     ["imports text", "line 2: text(...)"]),
    ("import sqlalchemy as sa\nQ = sa.text('SELECT 1')\n", False, ["line 2: text(...)"]),
    ("async def f(conn):\n    await conn.execute(Q)\n", False, ["line 2: .execute(...)"]),
    ("async def f(conn):\n    await conn.fetchrow('SELECT 1')\n", True,
     ["line 2: .fetchrow(...)"]),
    ("Q = Statement('m.q', 's', 'SELECT 1')\nasync def f(conn):\n    await conn.execute(Q.text)\n",
     False, ["line 3: .execute(...)"]),
    ("Q = Statement('m.q', 's', 'SELECT 1')\nasync def f(conn):\n    await conn.execute(Q.text)\n",
     True, []),
    ("async def f(conn, r):\n    await conn.fetchval(r.text)\n", True, ["line 2: .fetchval(...)"]),
    ("from service.db.wakeups import WAKE_WORKERS\nasync def f(conn):\n"
     "    await conn.execute(WAKE_WORKERS.text)\n", True, []),
    ("async def f(result):\n    return result.scalar()\n", False, []),
])
def test_the_rule_sees_raw_sql(tmp_path: Path, source: str, asyncpg: bool,
                               found: list[str]) -> None:
    module = tmp_path / "m.py"
    module.write_text(source)
    assert raw_sql(module, asyncpg) == found


def count(pattern: str, sql: str) -> int:
    return len(re.findall(pattern, sql))


@pytest.mark.parametrize("statement", ALL, ids=lambda s: s.name)
def test_the_shared_predicates_are_never_copied(statement: Statement) -> None:
    sql = statement.text
    # every comparison of these columns with a clock comes from its fragment
    assert count(r"next_attempt_at <=", sql) == count(re.escape(ready_item("@")).replace(
        "@", r"\S+"), sql)
    assert count(r"lease_expires_at <=", sql) == count(re.escape(expired_lease("@")).replace(
        "@", r"\S+"), sql) + count(re.escape(ready_item("@")).replace("@", r"\S+"), sql)
    assert count(r"closed_until (<=|>|<|>=) ", sql) == count(re.escape(CLOSURE_OVER), sql)


def test_the_predicates_are_where_they_must_be() -> None:
    assert buckets._ELIGIBLE.text.count(ready_item("now()")) == 4  # two probes, two halves
    assert buckets._ELIGIBLE.text.count(OPEN_SCOPE) == 2
    assert claims._ADMIT.text.count(ready_item("clock.now")) == 1
    assert expired_lease("clock.now") not in claims._ADMIT.text  # ready_item takes them
    assert claims._ADMIT.text.count(OPEN_SCOPE) == 1
    # the scopes listing and the gauge count one set, on one clock
    assert scope_controls._LIST.text.count(ready_item("now()")) == 1
    assert gauges._LEDGER_ELIGIBLE.text.count(ready_item("now()")) == 1
    assert gauges._LEDGER_SCOPES.text.count(CLOSURE_OVER) == 1


def test_one_statement_wakes_the_workers() -> None:
    """Publication, a hold's release, a resume and webhook intake wake idle workers with
    the one statement of service/db/wakeups.py, on the channel the workers listen on."""
    assert wakeups.WAKE_WORKERS.sql == f"NOTIFY {wakeups.RELEASED_CHANNEL}"
    notifies = [s.name for s in ALL if "NOTIFY" in s.sql.upper().replace("PG_NOTIFY", "")]
    assert notifies == [wakeups.WAKE_WORKERS.name]
