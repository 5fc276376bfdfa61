"""The attempts of a pool's calls: each call a task that waits for its token's moment and a
free slot, is made through the call port (or handed back unmade: stopping, its scope held
here, started too late, not written in time, withheld by a hold), and leaves its items'
outcomes for the next flush (pending_writes.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from datetime import datetime

from opentelemetry.trace import Span

from service.config.policies import Policies, Policy
from service.observability.failures import InternalErrors
from service.observability.metrics import IN_FLIGHT, LeaseReturn, Where
from service.outcomes import UNKNOWN_POLICY_VERSION, Answer, Failure
from service.upstreams.deletion_api import CallResult
from service.worker.attempt_outcomes import AttemptOutcomes
from service.worker.call_traces import CallTraces, ClaimRound
from service.worker.calls import Call, is_confirmation_read
from service.worker.hold_gate import HoldGate
from service.worker.pacing import CallLimit, LocalHolds
from service.worker.pending_writes import PendingWrites
from service.worker.ports import CallPort, Clock

log = logging.getLogger("service.worker")

class Attempts:
    """The calls started and not finished yet (`in_flight`), at most `concurrency` of them
    made at once; `slot_freed` is set as each finishes, `flush_now` when a batch of
    outcomes is full."""

    def __init__(self, calls: CallPort, policies: Policies, *, concurrency: int, clock: Clock,
                 limit: CallLimit, gate: HoldGate, holds: LocalHolds, writes: PendingWrites,
                 outcomes: AttemptOutcomes, errors: InternalErrors,
                 stopping: asyncio.Event, traces: CallTraces) -> None:
        self._port = calls
        self._policies = policies
        self._clock = clock
        self._limit = limit
        self._gate = gate
        self._holds = holds
        self._writes = writes
        self._outcomes = outcomes
        self._errors = errors
        self._stopping = stopping
        self._traces = traces
        # calls claimed ahead wait here: at most `concurrency` upstream calls at once
        self._slots = asyncio.Semaphore(concurrency)
        self._not_started: dict[asyncio.Task[None], Call] = {}  # created, first step not run
        self.in_flight: set[asyncio.Task[None]] = set()
        self.finished = 0  # calls finished since start
        self.slot_freed = asyncio.Event()
        self.flush_now = asyncio.Event()

    def start(self, call: Call, due: float, give_up: float, round_no: int,
              claim: ClaimRound | None = None) -> None:
        """Start `call`'s attempt: made at `due` (this clock's monotonic seconds), handed
        back if it cannot be written by `give_up`; `claim`: its round (tracing on)."""
        task = asyncio.create_task(self._attempt(call, due, give_up, round_no, claim))
        self.in_flight.add(task)
        self._not_started[task] = call
        task.add_done_callback(self._call_done)

    async def drain(self) -> None:
        """Wait for every call in flight."""
        if self.in_flight:
            await asyncio.gather(*list(self.in_flight), return_exceptions=True)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self.in_flight.discard(task)
        self.finished += 1
        self.slot_freed.set()
        call = self._not_started.pop(task, None)
        if call is not None:
            # cancelled before its first step, so `_attempt`'s own cleanup never ran: the
            # call was not made, its lease goes back and it leaves the in-flight gauge
            log.warning("call cancelled before it started; its lease goes back",
                        extra={"items": len(call)})
            self._gate.finished(call)
            IN_FLIGHT.dec()
            self._writes.unstarted.add([(call, LeaseReturn.SHUTDOWN)])

    async def _attempt(self, call: Call, due: float = 0.0, give_up: float = math.inf,
                       round_no: int = 0, claim: ClaimRound | None = None) -> None:
        clock = self._clock
        lease = call[0]
        self._not_started.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        try:
            try:
                delay = due - clock.monotonic()
                if delay > 0:
                    await clock.sleep(delay)
                await self._slots.acquire()  # a call claimed ahead waits here for a slot
            except asyncio.CancelledError:
                # abandoned at shutdown before it was made: its lease goes back with the
                # last flush instead of waiting to expire
                self._writes.unstarted.add([(call, LeaseReturn.SHUTDOWN)])
                raise
            try:
                unstarted = (LeaseReturn.SHUTDOWN if self._stopping.is_set()
                             else LeaseReturn.SCOPE_HELD if lease.scope in self._holds
                             else LeaseReturn.LATE_START if clock.monotonic() > give_up
                             else None)
                if unstarted is not None:
                    self._not_made(call, unstarted, round_no)
                    return
                policy = self._policies.policy(lease.policy)
                started = clock.now()
                span = self._traces.call(call, policy, claim)
                if policy is None or policy.version != lease.policy_version:
                    result = CallResult(Answer(failure=Failure.INVALID_REQUEST), 0.0)
                    reason_override: str | None = UNKNOWN_POLICY_VERSION
                else:
                    reason_override = None
                    # lateness counts until the request is written: taking or opening a
                    # connection can outlast the tolerance (service/protocols/transport.py)
                    with self._traces.current(span):
                        result = await self._call(policy, call,
                                                  give_up if give_up < math.inf else None)
                    if result.answer.failure is Failure.SENT_TOO_LATE:
                        self._not_made(call, LeaseReturn.LATE_START, round_no, span)
                        return
                    if result.answer.failure is Failure.WITHHELD:
                        self._not_made(call, LeaseReturn.HELD if self._gate.revoked(call)
                                       else LeaseReturn.LEASE_ENDING, round_no, span)
                        return
            finally:
                self._slots.release()
            with self._traces.current(span):
                await self._finished_call(call, policy, result, started, reason_override,
                                          span)
        finally:
            self._gate.finished(call)
            IN_FLIGHT.dec()

    async def _finished_call(self, call: Call, policy: Policy | None, result: CallResult,
                             started: datetime, reason_override: str | None,
                             span: Span | None) -> None:
        """Its items' outcomes wait for the next flush (at once when a batch is full)."""
        outcomes = self._writes.outcomes
        completions = self._outcomes.of(call, policy, result, started, reason_override)
        self._traces.answered(span, result, completions)
        outcomes.add(completions)
        if outcomes.full:
            self.flush_now.set()
        signals = self._writes.signals
        if signals.urgent:
            # a throttle or credential signal acts now, not at the next flush: every
            # replica's next admission round must already see the scope closed (what
            # fails waits for the next flush, and is counted)
            await signals.flush(Where.URGENT_SIGNALS)

    def _not_made(self, call: Call, reason: LeaseReturn, round_no: int,
                  span: Span | None = None) -> None:
        """A call not made: its leases go back with the next flush (one statement for all
        of them), no attempt counted; a late one also tells the round."""
        self._traces.not_made(span, reason.value)
        if reason is LeaseReturn.LATE_START:
            self._limit.started_late(round_no)
        self._writes.unstarted.add([(call, reason)])

    async def _call(self, policy: Policy, call: Call, send_by: float | None) -> CallResult:
        """Make the call, written by `send_by` and only through the hold gate
        (hold_gate.py), both checked by the transport at the write."""
        lease = call[0]
        calls = self._port
        gate = self._gate.gate(call, self._clock.monotonic)
        try:
            if is_confirmation_read(policy, call):
                return await calls.confirm(policy, lease, send_by=send_by, gate=gate)
            if len(call) == 1 and policy.per_call == 1 and policy.config.target is None:
                return await calls.delete(policy, lease, send_by=send_by, gate=gate)
            return await calls.delete_batch(policy, call, send_by=send_by, gate=gate)
        except Exception as exc:
            # A bug or an unforeseen client error must still end in an outcome; the request
            # may have been sent, so it is `unknown` (the same key next time).
            self._errors.caught(Where.CALL, exc, policy=policy.name)
            return CallResult(Answer(failure=Failure.PROTOCOL), 0.0)
