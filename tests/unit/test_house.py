"""The house's size rule ([tool.sweeper.house] in pyproject.toml): no module in service/ or
drills/ over max_module_lines, no function over max_function_lines, except those named there
with their reason; and no exception kept for a module or function that no longer needs it."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any

from tests.conftest import REPO_ROOT

HOUSE: dict[str, Any] = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())[
    "tool"]["sweeper"]["house"]


def sources() -> list[Path]:
    return sorted(p for folder in ("service", "drills") for p in (REPO_ROOT / folder).rglob("*.py"))


def name(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def module_lengths() -> dict[str, int]:
    return {name(p): len(p.read_text().splitlines()) for p in sources()}


def function_lengths() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                key = f"{name(path)}:{node.name}"
                found[key] = max(found.get(key, 0), node.end_lineno - node.lineno + 1)
    return found


def test_no_module_is_longer_than_the_rule() -> None:
    over = {m: n for m, n in module_lengths().items() if n > HOUSE["max_module_lines"]}
    assert set(over) <= set(HOUSE["long_modules"]), over


def test_no_function_is_longer_than_the_rule() -> None:
    over = {f: n for f, n in function_lengths().items() if n > HOUSE["max_function_lines"]}
    assert set(over) <= set(HOUSE["long_functions"]), over


def test_every_exception_is_still_needed() -> None:
    modules, functions = module_lengths(), function_lengths()
    stale = [m for m in HOUSE["long_modules"] if modules.get(m, 0) <= HOUSE["max_module_lines"]]
    stale += [f for f in HOUSE["long_functions"]
              if functions.get(f, 0) <= HOUSE["max_function_lines"]]
    assert stale == []
