"""One seeded Sweeper per test process, shared by every contract test in it (seeding and
settling cost seconds; the fuzzing only adds to the ledger, and each test reads whatever
state it finds, as a client would)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _admin, _with_database
from tests.contract.seeded import Seeded, seeded_sweeper


@pytest.fixture(scope="session")
def sweeper(pg_server_url: str, template_db: str) -> Iterator[Seeded]:
    name = f"sweeper_c_{uuid.uuid4().hex[:12]}"
    _admin(pg_server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    try:
        with seeded_sweeper(_with_database(pg_server_url, name)) as seeded:
            yield seeded
    finally:
        _admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The inner loop (`-m "not slow"`) does not import these modules: every test in them is
    slow, and schemathesis builds its tests from the contract while collecting (seconds of
    each test process's start, before any test runs)."""
    if config.getoption("markexpr").split() == ["not", "slow"]:
        return collection_path.suffix == ".py" and collection_path.name.startswith("test_")
    return None
