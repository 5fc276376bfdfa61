"""`python -m drills.agent worker`: a `sweeper worker` process wired as the product wires
one (service/worker/process.py: what it runs on, the pool's ports on that, the pool run until
SIGTERM), with the faults a drill names wrapped around those ports (service/worker/ports.py)
before the pool is built on them. Production never imports this module; the variables below
are read only here. (No probes on SWEEPER_METRICS_PORT, no migration on start: the drills
ask for neither of an agent.)

- ``SWEEPER_DRILL_CRASH_AFTER_CLAIM=<object id>``: SIGKILL this process as soon as an
  admission that leased that object has committed (before any upstream call).
- ``SWEEPER_DRILL_CRASH_BEFORE_COMMIT=<object id>``: SIGKILL this process when it is about
  to commit a succeeded outcome for that object (the upstream already said 2xx).
- ``SWEEPER_DRILL_CRASH_ON_ANSWER=<object id>``: SIGKILL this process whenever the upstream
  answers a call for that object (a poison answer that crashes the worker every time).
- ``SWEEPER_DRILL_CLOCK_SHIFT_SECONDS=<seconds>``: the pool's wall clock runs that far
  ahead (negative: behind). Its monotonic clock is left alone, as a real clock step
  leaves it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy.engine import URL

from service.config.policies import Policies, Policy
from service.config.settings import Settings
from service.ledger.claims import Admission, Lease
from service.ledger.completions import Completion
from service.protocols.transport import SendGate
from service.upstreams.deletion_api import CallResult
from service.worker.ports import AdmissionPort, CallPort, Clock, CompletionPort, Ports
from service.worker.process import open_worker_process


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclasses.dataclass
class CrashAfterClaim:
    inner: AdmissionPort
    object_id: str

    async def eligible_scopes(self, cursor: str, limit: int) -> list[tuple[str, int]]:
        return await self.inner.eligible_scopes(cursor, limit)

    async def admit(self, wants: Mapping[str, int]) -> Admission:
        admitted = await self.inner.admit(wants)  # committed on return
        if any(lease.object_id == self.object_id for lease in admitted.leases):
            _crash()
        return admitted

    async def database_time(self) -> float:
        return await self.inner.database_time()


@dataclasses.dataclass
class CrashBeforeCommit:
    inner: CompletionPort
    object_id: str

    async def complete(self, batch: Sequence[Completion]) -> list[int]:
        if any(c.lease.object_id == self.object_id and c.outcome == "succeeded"
               for c in batch):
            _crash()
        return await self.inner.complete(batch)

    async def hand_back(self, leases: Sequence[Lease], tokens: Sequence[int] | None = None
                        ) -> None:
        await self.inner.hand_back(leases, tokens)


@dataclasses.dataclass
class CrashOnAnswer:
    inner: CallPort
    object_id: str

    async def delete(self, policy: Policy, lease: Lease, *, send_by: float | None,
                     gate: SendGate | None) -> CallResult:
        result = await self.inner.delete(policy, lease, send_by=send_by, gate=gate)
        if lease.object_id == self.object_id:
            _crash()
        return result

    async def confirm(self, policy: Policy, lease: Lease, *, send_by: float | None,
                      gate: SendGate | None) -> CallResult:
        result = await self.inner.confirm(policy, lease, send_by=send_by, gate=gate)
        if lease.object_id == self.object_id:
            _crash()
        return result

    async def delete_batch(self, policy: Policy, leases: Sequence[Lease], *,
                           send_by: float | None, gate: SendGate | None) -> CallResult:
        result = await self.inner.delete_batch(policy, leases, send_by=send_by, gate=gate)
        if any(lease.object_id == self.object_id for lease in leases):
            _crash()
        return result



@dataclasses.dataclass
class ShiftedClock:
    inner: Clock
    shift: timedelta

    def monotonic(self) -> float:
        return self.inner.monotonic()

    def now(self) -> datetime:
        return self.inner.now() + self.shift

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def faults_from(env: Mapping[str, str]) -> Callable[[Ports], Ports]:
    """The port wrapper installing the faults `env` names (see the module docstring)."""
    after_claim = env.get("SWEEPER_DRILL_CRASH_AFTER_CLAIM")
    before_commit = env.get("SWEEPER_DRILL_CRASH_BEFORE_COMMIT")
    on_answer = env.get("SWEEPER_DRILL_CRASH_ON_ANSWER")
    shift = float(env.get("SWEEPER_DRILL_CLOCK_SHIFT_SECONDS", "0"))

    def wrap(ports: Ports) -> Ports:
        if after_claim:
            ports = dataclasses.replace(
                ports, admission=CrashAfterClaim(ports.admission, after_claim))
        if before_commit:
            ports = dataclasses.replace(
                ports, completion=CrashBeforeCommit(ports.completion, before_commit))
        if on_answer:
            ports = dataclasses.replace(ports, calls=CrashOnAnswer(ports.calls, on_answer))
        if shift:
            ports = dataclasses.replace(
                ports, clock=ShiftedClock(ports.clock, timedelta(seconds=shift)))
        return ports

    return wrap


async def run_wrapped_worker(settings: Settings, policies: Policies, url: URL,
                             wrap: Callable[[Ports], Ports]) -> None:
    """A worker process's pool on its own ports as `wrap` wraps them."""
    async with open_worker_process(settings, policies, url) as process:
        await process.run(process.pool(wrap(process.ports())))


def main(argv: list[str] | None = None) -> int:
    """`sweeper worker` with the faults of this process's environment."""
    from service.commands import cli, startup
    from service.commands.exits import Exit
    from service.commands.parser import build_parser

    args = build_parser().parse_args(argv if argv is not None else sys.argv[1:])
    if args.command != "worker":
        print("drills.agent runs `worker` only", file=sys.stderr)
        return Exit.USAGE
    wrap = faults_from(os.environ)

    def worker(_args: object) -> int:
        settings, policies = startup.load_config()
        with startup.database(settings) as url:
            asyncio.run(run_wrapped_worker(settings, policies, url, wrap))
        return Exit.OK

    args.func = worker
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
