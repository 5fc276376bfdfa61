"""The fake upstream now ships in the package (`service.drills.upstream`) so that
`sweeper drill` can start it on an operator's machine; this module keeps the old import path
and `python -m tests.fakes.upstream` working."""

from __future__ import annotations

import sys

from service.drills.upstream import Call, FakeUpstream, Fault, main

__all__ = ["Call", "FakeUpstream", "Fault", "main"]

if __name__ == "__main__":
    sys.exit(main())
