"""What the import rules cannot see: a process started as `python -m tests.x` depends on the
tests as much as an import does. The import rules themselves (layers, no cycles, the product
never importing tests, bench or drills) are import-linter's contracts in pyproject.toml,
checked by `lint-imports` in .ci/run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


def modules(folder: str) -> list[Path]:
    return sorted((REPO_ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["service", "bench", "drills"])
def test_nothing_outside_the_tests_starts_test_modules(folder: str) -> None:
    starting = {p.relative_to(REPO_ROOT).as_posix() for p in modules(folder)
                if '"-m", "tests.' in p.read_text()}
    assert starting == set()


def test_the_documented_map_is_the_checked_one() -> None:
    """docs/development.md's layer table lists the packages in the order the layers
    contract checks them, every child of service/ once."""
    contract = next(c for c in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())[
        "tool"]["importlinter"]["contracts"] if c.get("containers") == ["service"])
    checked = [sorted(p.strip() for p in layer.split("|")) for layer in contract["layers"]]
    text = (REPO_ROOT / "docs" / "development.md").read_text()
    table = text[text.index("| layer | owns |"):].split("\n\n")[0].splitlines()[2:]
    documented = [sorted(re.findall(r"`([a-z_]+)`", row.split("|")[1])) for row in table]
    assert documented == checked
    children = {p.stem for p in (REPO_ROOT / "service").glob("*.py")} | {
        p.name for p in (REPO_ROOT / "service").iterdir() if (p / "__init__.py").exists()}
    children.discard("__init__")
    assert children == {name for layer in checked for name in layer}
