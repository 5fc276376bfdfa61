"""The statement convention (service/db/statements.py): every statement of the limiter, the
claims, the scopes and the metrics is a named `Statement` run through that module, and the
shared predicates appear in them only as the one fragment each, never as a copy."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType

import pytest

from service import claims, limiter, metrics, scopes
from service.db.statements import (
    CLOSURE_OVER,
    OPEN_SCOPE,
    Statement,
    expired_lease,
    ready_item,
)

MODULES = (claims, limiter, metrics, scopes)


def statements_of(module: ModuleType) -> list[Statement]:
    return [v for v in vars(module).values() if isinstance(v, Statement)]


ALL = [s for m in MODULES for s in statements_of(m)]


def test_every_statement_is_named_after_its_module_once() -> None:
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[-1]
        assert statements_of(module), short
        for s in statements_of(module):
            assert s.name.startswith(f"{short}."), s.name
    names = [s.name for s in ALL]
    assert len(names) == len(set(names))


def test_a_statement_is_sent_with_its_name() -> None:
    assert claims._ADMIT.text.startswith("/* claims.admit */ WITH clock AS")


@pytest.mark.parametrize(("name", "summary", "error"), [
    ("admit", "a summary", "is not module.what"), ("claims.admit", "", "one line"),
    ("claims.admit", "two\nlines", "one line")])
def test_a_statement_needs_a_dotted_name_and_a_one_line_summary(name: str, summary: str,
                                                                 error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Statement(name, summary, "SELECT 1")


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_statements_run_only_through_the_convention(module: ModuleType) -> None:
    """No inline `text(...)` and no `.execute(...)` of its own: every statement is a
    `Statement` constant run by fetch, fetch_none or run."""
    tree = ast.parse(Path(str(module.__file__)).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "sqlalchemy" for alias in node.names}
    assert "text" not in imported
    calls = [node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "execute"]
    assert calls == []


def count(pattern: str, sql: str) -> int:
    return len(re.findall(pattern, sql))


@pytest.mark.parametrize("statement", ALL, ids=lambda s: s.name)
def test_the_shared_predicates_are_never_copied(statement: Statement) -> None:
    sql = statement.text
    # every comparison of these columns with a clock comes from its fragment
    assert count(r"next_attempt_at <=", sql) == count(re.escape(ready_item("@")).replace(
        "@", r"\S+"), sql)
    assert count(r"lease_expires_at <=", sql) == count(re.escape(expired_lease("@")).replace(
        "@", r"\S+"), sql)
    assert count(r"closed_until (<=|>|<|>=) ", sql) == count(re.escape(CLOSURE_OVER), sql)


def test_the_predicates_are_where_they_must_be() -> None:
    assert limiter._ELIGIBLE.text.count(ready_item("now()")) == 2
    assert limiter._ELIGIBLE.text.count(expired_lease("now()")) == 1
    assert limiter._ELIGIBLE.text.count(OPEN_SCOPE) == 1
    assert claims._ADMIT.text.count(ready_item("clock.now")) == 1
    assert claims._ADMIT.text.count(expired_lease("clock.now")) == 1
    assert claims._ADMIT.text.count(OPEN_SCOPE) == 1
    # the scopes listing and the gauge count one set, on one clock
    assert scopes._LIST.text.count(ready_item("now()")) == 1
    assert metrics._LEDGER_ELIGIBLE.text.count(ready_item("now()")) == 1
    assert metrics._LEDGER_SCOPES.text.count(CLOSURE_OVER) == 1

