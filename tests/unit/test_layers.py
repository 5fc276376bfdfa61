"""What the import rules cannot see: a process started as `python -m tests.x` depends on the
tests as much as an import does. The import rules themselves (layers, no cycles, the product
never importing tests, bench or drills) are import-linter's contracts in pyproject.toml,
checked by `lint-imports` in .ci/run."""

from __future__ import annotations

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
