"""The tests' import path for the fake upstream, which ships in the package
(`drills.upstream`) so that `sweeper drill` can start it on an operator's machine. Re-exports
its public names, keeps `python -m tests.fakes.upstream` working, and adds test-only helpers
built on its public API."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

from drills.upstream import Call, FakeUpstream, Fault, main

__all__ = ["Call", "FakeUpstream", "Fault", "main", "over_limit"]


def over_limit(per_second: int) -> Callable[[Call], bool]:
    """A `match` for `FakeUpstream.inject`: true for a call once `per_second` calls of its
    scope were let through in the trailing second. Queued alone with a 429 status fault and
    `times=None`, it throttles with headers the test chooses (the fake's own limit always
    sends an integer Retry-After of at least 1). The fake calls it under its lock."""
    if per_second < 1:
        raise ValueError("per_second must be >= 1")
    passed: dict[str, collections.deque[float]] = {}

    def match(call: Call) -> bool:
        window = passed.setdefault(call.scope, collections.deque())
        while window and window[0] <= call.received_at - 1.0:
            window.popleft()
        if len(window) < per_second:
            window.append(call.received_at)
            return False
        return True

    return match


if __name__ == "__main__":
    sys.exit(main())
