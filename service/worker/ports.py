"""The worker's ports: everything the pool needs from outside its own event loop.

The pool (`pool.py`) sees only these. `postgres.py` implements the ledger ports on the
database, `process.py` wires a process; tests drive the pool's rounds with in-memory
implementations (tests/unit/test_worker_rounds.py) and drills wrap the real ones to inject
faults (drills/agent.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from service.budget.credential_waits import Credentials
from service.budget.rules import Closure
from service.config.policies import Policy
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.outcomes import Answer, Failure
from service.sweeps.store_targets import StoreTargets
from service.upstreams.deletion_api import CallResult, Upstreams
from service.worker.hold_gate import HoldCover

log = logging.getLogger("service.worker")


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
    """The upstream deletion call of one lease, and the read confirming it."""

    async def delete(self, policy: Policy, lease: Lease) -> CallResult: ...

    async def confirm(self, policy: Policy, lease: Lease) -> CallResult:
        """The policy's confirmation read of the lease's object (its `confirm`)."""
        ...

    async def delete_batch(self, policy: Policy, leases: Sequence[Lease]) -> CallResult:
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


class NoHolds:
    """No legal holds to learn of (the in-memory ports of the pool's unit tests)."""

    async def latest_hold(self) -> int:
        return 0

    async def holds_since(self, after: int) -> list[HoldCover]:
        return []

    async def acknowledge(self, revoked: Mapping[int, Sequence[int]]) -> None:
        return None


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime:
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class UpstreamCalls:
    """Calls through the pooled HTTP clients of the policies' upstreams, with the tenant's
    credential where the upstream takes one per tenant."""

    def __init__(self, upstreams: Upstreams, credentials: Credentials | None = None,
                 targets: StoreTargets | None = None) -> None:
        self.upstreams = upstreams
        self.credentials = credentials or Credentials({})
        self.targets = targets  # the policies with a store target: a statement, not a call

    async def delete(self, policy: Policy, lease: Lease) -> CallResult:
        if policy.config.target is not None:
            return await self.delete_batch(policy, [lease])
        found = await self._credential(policy, lease)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).delete(
            policy, tenant_id=lease.tenant_id, object_id=lease.object_id,
            operation_key=lease.operation_key, object_version=lease.object_version,
            credential=found)

    async def confirm(self, policy: Policy, lease: Lease) -> CallResult:
        found = await self._credential(policy, lease)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).confirm(
            policy, tenant_id=lease.tenant_id, object_id=lease.object_id,
            object_version=lease.object_version, credential=found)

    async def delete_batch(self, policy: Policy, leases: Sequence[Lease]) -> CallResult:
        if policy.config.target is not None:
            if self.targets is None:  # a process wired without its stores: a bug
                raise RuntimeError(f"policy {policy.name!r} has a store target and this "
                                   "process has no stores")
            return await self.targets.delete(policy, leases)
        first = leases[0]
        found = await self._credential(policy, first)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).delete(
            policy, tenant_id=first.tenant_id, object_id="",
            operation_key=batch_key(policy, leases), credential=found,
            object_ids=[lease.object_id for lease in leases])

    async def _credential(self, policy: Policy, lease: Lease) -> str | CallResult | None:
        """The tenant's credential (None: the upstream takes none, or it has none), or the
        result of a call that cannot be made because its lookup failed."""
        upstream = policy.config.upstream
        if upstream not in self.credentials.upstreams:
            return None
        try:
            return await self.credentials.get(lease.tenant_id, upstream)
        except Exception as exc:  # the store's database: nothing was sent
            log.warning("credential lookup failed; the call waits",
                        extra={"scope": lease.scope, "error": type(exc).__name__})
            return CallResult(Answer(failure=Failure.CREDENTIAL_UNAVAILABLE), 0.0)



def batch_key(policy: Policy, leases: Sequence[Lease]) -> str:
    """A batch call's Idempotency-Key: the batch's identity, from the policy's version and
    its items' own operation keys in order (the same items sent again send the same key)."""
    digest = hashlib.sha256(f"{policy.name}\x00{policy.version}".encode())
    for key in sorted(lease.operation_key for lease in leases):
        digest.update(b"\x00" + key.encode())
    return digest.hexdigest()


class NoWakeups:
    """No release notifications: the pool polls (with backoff) alone."""

    async def listen(self, wake: Callable[[], None],
                     held: Callable[[], None] | None = None) -> None:
        await asyncio.Event().wait()


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
    holds: HoldPort = field(default_factory=NoHolds)
