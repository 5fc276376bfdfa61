"""Which database errors mean "busy, retry later" (503) rather than a bug (500)."""

from __future__ import annotations

import pytest
from sqlalchemy import exc as sa_exc

from service.db.engine import is_busy


class _DriverError(Exception):
    def __init__(self, pgcode: str) -> None:
        super().__init__(pgcode)
        self.pgcode = pgcode


@pytest.mark.parametrize(("sqlstate", "busy"), [
    ("57014", True),   # statement timeout, e.g. behind an idle-in-transaction lock holder
    ("55P03", True),   # lock timeout
    ("40P01", True),   # deadlock victim
    ("40001", True),   # serialization failure
    ("53300", True),   # too many connections
    ("53200", True),   # out of memory
    ("23505", False),  # unique violation: a bug or a conflict, not load
    ("42P01", False),  # undefined table
])
def test_busy_sqlstates(sqlstate: str, busy: bool) -> None:
    error = sa_exc.DBAPIError("INSERT ...", {}, _DriverError(sqlstate))
    assert is_busy(error) is busy


def test_other_errors_are_not_busy() -> None:
    assert not is_busy(RuntimeError("boom"))
