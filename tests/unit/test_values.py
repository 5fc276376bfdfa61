"""`value` records (service/values.py): compared and hashed by their fields like a frozen
dataclass, and read-only where it is checked, to mypy --strict."""

from __future__ import annotations

import dataclasses
import textwrap
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from mypy import api as mypy_api

from service.ledger.claims import Lease
from service.values import value
from tests.conftest import REPO_ROOT

NOW = datetime(2026, 12, 5, tzinfo=UTC)


def lease(attempt: int = 1) -> Lease:
    token = uuid.UUID(int=7)
    return Lease(1, "t", "o", "carts", 1, "k" * 64, "s", token, attempt, NOW)


def test_a_value_compares_and_hashes_by_its_fields_and_has_no_dict() -> None:
    assert lease() == lease() and hash(lease()) == hash(lease())
    assert lease() != lease(attempt=2)
    assert {lease(), lease()} == {lease()}
    assert not hasattr(lease(), "__dict__")
    assert dataclasses.replace(lease(), attempt=2) == lease(attempt=2)


def test_value_keeps_defaults_and_the_dataclass_api() -> None:
    @value
    class Point:
        x: int
        y: int = 0

    assert Point(1) == Point(1, 0)
    assert [f.name for f in dataclasses.fields(Point)] == ["x", "y"]
    assert Point.__slots__ == ("x", "y")


@pytest.mark.slow
def test_mypy_refuses_an_assignment_to_a_field(tmp_path: Path) -> None:
    snippet = tmp_path / "mutate.py"
    snippet.write_text(textwrap.dedent("""
        from service.ledger.claims import Lease
        from service.ledger.completions import Completion

        def bump(lease: Lease, done: Completion) -> None:
            lease.attempt = 2
            done.status = "dead"
    """))
    out, _, status = mypy_api.run([
        "--strict", "--no-incremental", "--config-file", str(REPO_ROOT / "pyproject.toml"),
        str(snippet)])
    assert status == 1
    assert 'Property "attempt" defined in "Lease" is read-only' in out
    assert 'Property "status" defined in "Completion" is read-only' in out
