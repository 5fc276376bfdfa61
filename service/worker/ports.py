"""The worker's ports: everything the pool needs from outside its own event loop, and the
value types they speak in.

The pool (`pool.py`) sees only these. `postgres.py` implements the ledger ports on the
database, `upstream_calls.py` the call port, `local_ports.py` the clock and the ports a
process without a database answers itself; `process.py` wires a process. Tests drive the
pool's rounds with in-memory implementations (tests/unit/test_worker_rounds.py) and drills
wrap the real ones to inject faults (drills/agent.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from service.budget.rules import Closure
from service.config.policies import Policy
from service.history.tally import Tally
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.protocols.transport import SendGate
from service.upstreams.deletion_api import CallResult
from service.worker.hold_gate import HoldCover


class AdmissionPort(Protocol):
    """Which scopes have work, and one admission: tokens taken and items leased together,
    committed on return."""

    async def eligible_scopes(self, cursor: str, limit: int) -> list[tuple[str, int]]:
        """Up to `limit` (scope, weight) pairs with ready items, round-robin after `cursor`."""
        ...

    async def admit(self, wants: Mapping[str, int]) -> Admission:
        """Take up to wants[scope] tokens per scope and lease that many items."""
        ...

    async def database_time(self) -> float:
        """The database's clock now, Unix seconds: the budget's schedule runs on it."""
        ...


class CompletionPort(Protocol):
    """Where attempts end: outcomes committed, unstarted leases handed back."""

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        """Commit the outcomes; the ids whose lease was no longer ours (fenced)."""
        ...

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None:
        """Return leases never called, and their tokens (`tokens[i]` for lease i, default
        one each: a batch's call holds one for all its leases), without an attempt."""
        ...


class ScopeSignalPort(Protocol):
    """What answers do to scopes, for every replica (see service.budget.answer_effects)."""

    async def close(self, closures: Mapping[str, Closure]) -> None: ...

    async def pause(self, scopes: Sequence[str], reason: str) -> list[str]:
        """Pause scopes; the ones that were running."""
        ...

    async def recovered(self, scopes: Sequence[str]) -> None: ...

    async def adjust(self, refunds: Mapping[str, float], caps: Mapping[str, float]) -> None:
        """Give tokens back (or take them) and lower buckets to what the upstream says is
        left; both in calls' worth of tokens."""
        ...


class CallPort(Protocol):
    """The upstream deletion call of one lease, and the read confirming it. Each is made
    only if its request can be written by `send_by` (time.monotonic(); None: no limit) and
    `gate()` says yes in the step that writes it (None: no gate); otherwise it is not made
    at all and answers SENT_TOO_LATE or WITHHELD."""

    async def delete(self, policy: Policy, lease: Lease, *, send_by: float | None,
                     gate: SendGate | None) -> CallResult: ...

    async def confirm(self, policy: Policy, lease: Lease, *, send_by: float | None,
                      gate: SendGate | None) -> CallResult:
        """The policy's confirmation read of the lease's object (its `confirm`)."""
        ...

    async def delete_batch(self, policy: Policy, leases: Sequence[Lease], *,
                           send_by: float | None, gate: SendGate | None) -> CallResult:
        """One call deleting every lease's object (a batch policy's, one scope's)."""
        ...


class Clock(Protocol):
    """This process's clocks: monotonic for schedules, wall time for what is recorded."""

    def monotonic(self) -> float: ...

    def now(self) -> datetime: ...

    async def sleep(self, seconds: float) -> None: ...


class WakeupPort(Protocol):
    """Tells an idle pool that items were released (instead of waiting for its poll), and
    that a legal hold was placed."""

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        """Call `wake` on each release and `held` on each hold placed, until cancelled;
        survives outages."""
        ...


class HoldPort(Protocol):
    """Legal holds as a worker process learns of them (hold_gate.py)."""

    async def latest_hold(self) -> int:
        """The newest hold's id (0: none)."""
        ...

    async def holds_since(self, after: int) -> list[HoldCover]:
        """The holds in force placed after hold `after`, oldest first."""
        ...

    async def acknowledge(self, revoked: Mapping[int, Sequence[int]]) -> None:
        """This process knows these holds and took back these unstarted calls (by hold)."""
        ...


class MinutesPort(Protocol):
    """Where a process's tally of what it saw goes: the ledger's minutes, which the
    console's charts read (service/history/)."""

    async def add_minutes(self, tally: Tally) -> None: ...


@dataclass(frozen=True)
class Ports:
    """The pool's ports. `hold` keeps what a running pool reuses (the ledger's
    connections) open for as long as its loop runs."""

    admission: AdmissionPort
    completion: CompletionPort
    signals: ScopeSignalPort
    calls: CallPort
    clock: Clock
    wakeups: WakeupPort
    hold: Callable[[], AbstractAsyncContextManager[None]]
    holds: HoldPort
    minutes: MinutesPort
