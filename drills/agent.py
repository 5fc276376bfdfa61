"""`python -m drills.agent worker`: the ordinary `sweeper worker`, with the faults a
drill names installed first. Production never imports this module; the variables below are
read only here.

- ``SWEEPER_DRILL_CRASH_AFTER_CLAIM=<object id>``: SIGKILL this process as soon as a claim
  that leased that object has committed (before any upstream call).
- ``SWEEPER_DRILL_CRASH_BEFORE_COMMIT=<object id>``: SIGKILL this process when it is about
  to commit a succeeded outcome for that object (the upstream already said 2xx).
- ``SWEEPER_DRILL_CRASH_ON_ANSWER=<object id>``: SIGKILL this process whenever the upstream
  answers a call for that object (a poison answer that crashes the worker every time).
- ``SWEEPER_DRILL_CLOCK_SHIFT_SECONDS=<seconds>``: this process's wall clock (``time.time``
  and ``datetime.now`` in Sweeper's modules) runs that far ahead (negative: behind). The
  monotonic clock is left alone, as a real clock step leaves it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from datetime import datetime, tzinfo
from typing import Any

from service import claims, upstream, worker


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(env: dict[str, str]) -> None:
    """Install the faults `env` names (see the module docstring)."""
    after_claim = env.get("SWEEPER_DRILL_CRASH_AFTER_CLAIM")
    before_commit = env.get("SWEEPER_DRILL_CRASH_BEFORE_COMMIT")
    on_answer = env.get("SWEEPER_DRILL_CRASH_ON_ANSWER")
    shift = float(env.get("SWEEPER_DRILL_CLOCK_SHIFT_SECONDS", "0"))

    if after_claim:
        real_admit = claims.admit

        async def admit(*args: Any, **kwargs: Any) -> claims.Admission:
            admitted = await real_admit(*args, **kwargs)  # committed on return
            if any(lease.object_id == after_claim for lease in admitted.leases):
                _crash()
            return admitted

        claims.admit = admit

    if before_commit:
        real_complete = claims.complete

        async def complete(db: Any, completions: Sequence[claims.Completion]) -> list[int]:
            if any(c.lease.object_id == before_commit and c.outcome == "succeeded"
                   for c in completions):
                _crash()
            return await real_complete(db, completions)

        claims.complete = complete

    if on_answer:
        real_delete = upstream.UpstreamClient.delete

        async def delete(self: upstream.UpstreamClient, *args: Any, **kwargs: Any
                         ) -> upstream.CallResult:
            result = await real_delete(self, *args, **kwargs)
            if kwargs.get("object_id") == on_answer:
                _crash()
            return result

        upstream.UpstreamClient.delete = delete  # type: ignore[method-assign]

    if shift:
        real_time = time.time

        def shifted_time() -> float:
            return real_time() + shift

        class ShiftedDateTime(datetime):
            @classmethod
            def now(cls, tz: tzinfo | None = None) -> ShiftedDateTime:
                return cls.fromtimestamp(shifted_time(), tz)

        time.time = shifted_time
        for module in (worker, upstream):
            module.__dict__["datetime"] = ShiftedDateTime


def main(argv: list[str] | None = None) -> int:
    """Install the faults, then run the `sweeper` command line unchanged."""
    from service.cli import main as sweeper_main

    install(dict(os.environ))
    return sweeper_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
