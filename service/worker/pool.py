"""The worker pool: claim -> call -> classify -> complete, with bounded concurrency.

One pool per process. Claims are committed before any call starts, no transaction is open
during a call, and outcomes are committed in small groups (pending_writes.py). Idle pools
wake when items are released and otherwise poll with backoff. Everything outside the event
loop goes through the ports in `ports.py`.

The pool is the loop around one admission round (`run_once`): its warm-up, its polling and
wake-ups, its flushes and its shutdown. A round's leases become calls (calls.py), each made
by an attempt (attempts.py) whose answer becomes its items' completions
(attempt_outcomes.py); legal holds bind at the send (hold_gate.py, learned by
hold_watch.py); pacing.py decides how many calls a round starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from service.budget import rules
from service.budget.rules import Grant
from service.config.policies import Policies
from service.ledger.claims import Admission
from service.observability import tracing
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import (
    IN_FLIGHT,
    INTERNAL_ERRORS,
    LIMITER_WAITS,
    TOKENS_GRANTED,
    TOKENS_RETURNED,
    LeaseReturn,
    Where,
)
from service.worker.attempt_outcomes import AttemptOutcomes
from service.worker.attempts import Attempts
from service.worker.call_traces import CallTraces, ClaimRound
from service.worker.calls import Call, calls_of
from service.worker.hold_gate import HoldGate
from service.worker.hold_watch import HoldWatch
from service.worker.pacing import CallLimit, DatabaseClock, LocalHolds, ScopeCache
from service.worker.pending_writes import FLUSH_RETRY_S, PendingWrites
from service.worker.pipeline_metrics import PipelineCounts
from service.worker.ports import Ports

log = logging.getLogger("service.worker")

IDLE_POLL_MIN_S: Final = 0.05
IDLE_POLL_MAX_S: Final = 2.0
FLUSH_INTERVAL_S: Final = 0.02
FLUSH_STOP_TIMEOUT_S: Final = 5.0  # at shutdown, for a flush in progress to commit
LAST_FLUSH_TRIES: Final = 50  # at shutdown, FLUSH_RETRY_S apart, before giving up
ERROR_BACKOFF_MAX_S: Final = 5.0
FIRST_RETRY_S: Final = 1.0  # between tries of the step before the first claim
# At most this many items per admission round. Calls of a round start one after another on
# this event loop, and a token spent more than late_tolerance after its moment goes
# back unspent: large rounds start their last calls late. Smaller rounds also overlap: the
# next round's statements run while this round's calls do (bench/reports/design-notes.md,
# "The worker pool").
MAX_ITEMS_PER_ROUND: Final = 64
# Scopes asked for with work: one more than a round can serve. The statement reads every
# open scope whatever the limit, so a longer answer costs only its rows.
SCOPES_ASKED: Final = MAX_ITEMS_PER_ROUND + 1
CLOCK_SAMPLES: Final = 8  # round trips that calibrate the database-clock offset
# No real scope can carry this name (scope names have no control characters).
WARM_UP_SCOPE: Final = "\x01warm-up"


def worker_name() -> str:
    """A name unique to this process, recorded as lease owner and in attempts."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class WorkerPool:
    """Runs up to `concurrency` upstream calls at once. `run_once()` does one admission
    round (tests drive it directly); `run()` loops until `stop()`."""

    def __init__(self, ports: Ports, policies: Policies, *, concurrency: int, name: str,
                 grace_seconds: float = 20.0, rng: random.Random | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.ports = ports
        self.policies = policies
        self.concurrency = concurrency
        self.name = name
        self.grace_seconds = grace_seconds
        self._clock = ports.clock
        self._calls = CallLimit(concurrency)
        self._scopes = ScopeCache()
        self._holds = LocalHolds()
        self._errors = InternalErrors(log, self._clock.monotonic)
        self._counts = PipelineCounts()
        self._traces = CallTraces(tracing.tracer())
        self._writes = PendingWrites(ports.completion, ports.signals, self._counts,
                                     self._errors, self._clock, self._traces, ports.minutes)
        self._db_clock = DatabaseClock()
        self._cursor = ""
        self._per_call: dict[str, int] = {}  # scopes whose calls carry many items, as granted
        self.unwritten = 0  # outcomes the last flush at shutdown could not write
        self._wake = asyncio.Event()
        self._gate = HoldGate()  # holds bind at the send (hold_gate.py)
        self._hold_watch = HoldWatch(ports.holds, self._gate, self._clock, self._errors)
        self._stopping = asyncio.Event()
        self._flusher_stop = asyncio.Event()
        self._attempts = Attempts(
            ports.calls, policies, concurrency=concurrency, clock=self._clock,
            limit=self._calls, gate=self._gate, holds=self._holds, writes=self._writes,
            outcomes=AttemptOutcomes(name, self._clock, self._writes.signals, self._holds,
                                     self._errors, rng or random.Random()),
            errors=self._errors, stopping=self._stopping, traces=self._traces)
        self._in_flight = self._attempts.in_flight
        self.token_wait: float | None = None
        # the probes' view (service/worker/health.py): when the loop last turned, and
        # whether it is warmed up and not stopping
        self.turned_at = self._clock.monotonic()
        self.ready = False
        self.reclaimed = 0

    @property
    def completed(self) -> int:
        """Outcomes committed since start (fenced ones not counted)."""
        return self._writes.completed

    @property
    def fenced(self) -> int:
        """Outcomes refused since start: their lease was no longer this pool's."""
        return self._writes.fenced

    # -- one round -------------------------------------------------------------------

    async def run_once(self) -> int:
        """One admission round: pick scopes with work (round-robin, fair shares of the free
        slots), then in one statement take their tokens and claim at most that many items
        per scope (unused tokens never leave the bucket), and start the calls at once.
        Returns how many items were claimed."""
        self.token_wait = None
        round_no = self._calls.next_round()
        free = min(MAX_ITEMS_PER_ROUND, self._calls.claimable - len(self._in_flight))
        if free <= 0:
            return 0
        finished_before = self._attempts.finished
        wants = await self._wants(free)
        if not wants:
            return 0
        sent = self._clock.monotonic()
        with self._traces.claim_round() as traced:
            admitted = await self.ports.admission.admit(wants)
        self._calls.claim_answered(self._attempts.finished - finished_before)
        self._scopes.admitted(admitted, wants)
        received = self._clock.monotonic()
        by_scope = {g.scope: g for g in admitted.grants}
        self._per_call.update((g.scope, g.per_call) for g in admitted.grants
                              if g.per_call > 1 or g.scope in self._per_call)
        calls = calls_of(admitted.leases, by_scope)
        if not self._granted(admitted, calls) or not admitted.leases:
            return 0
        self.reclaimed += self._counts.claimed(admitted.leases)
        self._writes.tally.claimed(admitted.leases, self._clock.now())
        if self._stopping.is_set():
            # stop() arrived while the claim was committing: nothing was called yet, so the
            # leases and their tokens go back without counting an attempt
            self._writes.unstarted.add((c, LeaseReturn.SHUTDOWN) for c in calls)
            await self._writes.unstarted.flush()
            return 0
        self._start(calls, admitted, by_scope, (sent, received), round_no,
                    traced[0] if traced else None)
        return len(admitted.leases)

    async def _wants(self, free: int) -> dict[str, int]:
        """The items to ask for, by scope: the scopes with work after the cursor (the cached
        list, else asked), less those held here, fair shares of `free`."""
        scopes = self._scopes.known(self._cursor, self._clock.monotonic())
        if scopes is None:
            # a shorter answer than asked lists every scope with work, which the next
            # rounds take in turn without asking again
            scopes = await self.ports.admission.eligible_scopes(self._cursor, SCOPES_ASKED)
            self._scopes.found(scopes, SCOPES_ASKED, self._clock.monotonic())
        scopes = self._holds.without_held(scopes, self._clock.monotonic())[:free]
        if not scopes:
            return {}
        self._cursor = scopes[-1][0]
        # a round claims at most MAX_ITEMS_PER_ROUND items: a scope whose calls carry many
        # (a batch policy's, a store target's) asks for that many items' worth of calls,
        # at least one, so its claim answers within its tokens' lateness
        return {scope: min(n, max(1, MAX_ITEMS_PER_ROUND // self._per_call.get(scope, 1)))
                for scope, n in rules.fair_shares(scopes, free).items()}

    def _granted(self, admitted: Admission, calls: list[Call]) -> int:
        """Count the tokens granted and those left unused; with none granted, note how long
        until the next one (`token_wait`). The tokens granted."""
        granted = sum(g.granted for g in admitted.grants)
        TOKENS_GRANTED.inc(granted)
        if granted - len(calls):
            TOKENS_RETURNED.inc(granted - len(calls))
        waits = [g.wait_seconds for g in admitted.grants]
        if not granted and waits:  # scopes with work, open, and no token for any of them
            LIMITER_WAITS.inc()
            self.token_wait = min(waits)
        return granted

    def _start(self, calls: list[Call], admitted: Admission, by_scope: Mapping[str, Grant],
               claim: tuple[float, float], round_no: int, traced: ClaimRound | None) -> None:
        """Start each call's attempt (attempts.py), due when its token is on the database's
        schedule (at most the lookahead from now); a token whose moment passed long ago (a
        slow claim) is handed back rather than spent late, where it would crowd the next
        ones. `claim`: when the admission was sent and when its answer was received."""
        sent, received = claim
        # the local moment of each grant, on this process's calibrated database clock
        granted_at = {g.scope: self._db_clock.local(g.schedule_start, received)
                      for g in admitted.grants if g.granted}
        self._gate.leased(((lease, self._db_clock.to_local(lease.lease_expires_at.timestamp()))
                           for lease in admitted.leases), sent)
        IN_FLIGHT.inc(len(calls))
        position: Counter[str] = Counter()
        for call in calls:
            scope = call[0].scope
            grant = by_scope[scope]
            due = granted_at[scope] + grant.due_in(position[scope])
            position[scope] += 1
            self._attempts.start(call, due, due + rules.late_tolerance(grant.rate), round_no,
                                 traced)

    async def drain(self) -> bool:
        """Wait for every call in flight and commit their outcomes; whether all were."""
        await self._attempts.drain()
        return await self.flush(force=True)

    async def flush(self, force: bool = False) -> bool:
        """Write what waits (pending_writes.py): outcomes first, then hand-backs, then scope
        signals, none holding back another. True when all are written."""
        return await self._writes.flush(force)

    # -- the loop --------------------------------------------------------------------

    async def run(self, *, first: Callable[[], Awaitable[object]] | None = None) -> None:
        """Claim, call and complete until stop(); survives database outages. `first` runs
        before the first claim, tried again every FIRST_RETRY_S until it succeeds."""
        if first is not None:
            await self._first(first)
        async with self.ports.hold():
            await self._warm_up()
            listener = asyncio.create_task(self.ports.wakeups.listen(
                self._wake.set, self._hold_watch.placed.set))
            flusher = asyncio.create_task(self._flush_loop())
            watcher = asyncio.create_task(self._hold_watch.watch())
            self.ready = True
            try:
                await self._loop()
            finally:
                self.ready = False
                await self._finish(flusher, listener, watcher)

    async def _first(self, first: Callable[[], Awaitable[object]]) -> None:
        while not self._stopping.is_set():
            self.turned_at = self._clock.monotonic()
            try:
                await first()
                return
            except Exception as exc:
                if expected(exc):
                    log.warning("workers: waiting for the database before the first claim")
                else:
                    self._errors.caught(Where.FIRST_STEP, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_RETRY_S):
                    await self._stopping.wait()

    async def _loop(self) -> None:
        idle = IDLE_POLL_MIN_S
        error_backoff = 0.1
        while not self._stopping.is_set():
            self.turned_at = self._clock.monotonic()
            try:
                claimed = await self.run_once()
                error_backoff = 0.1
            except Exception as exc:
                if expected(exc):
                    log.warning("database unavailable or busy; claims paused",
                                extra={"retry_in_s": error_backoff})
                else:
                    self._errors.caught(Where.CLAIM, exc)
                await self._sleep(error_backoff)
                error_backoff = min(ERROR_BACKOFF_MAX_S, error_backoff * 2)
                continue
            if claimed:
                idle = IDLE_POLL_MIN_S
                if len(self._in_flight) >= self._calls.claimable:
                    await self._wait_for_slot()
                continue
            if self.token_wait is not None:
                # budget-bound: sleep until the next token, not a poll interval
                await self._sleep(min(max(self.token_wait, 0.001), IDLE_POLL_MAX_S))
                continue
            await self._sleep(idle)
            idle = min(IDLE_POLL_MAX_S, idle * 2)

    async def _warm_up(self) -> None:
        """Prepare the admission statements before the first token is taken: a cold first
        claim made this process spend its first tokens late. (The HTTP client has nothing to
        prepare: service/protocols/transport.py builds its TLS context when it is made.)"""
        try:
            # calibrate the database-clock offset before the first grant: a first sample
            # taken on a cold connection would place this process's first calls late
            for _ in range(CLOCK_SAMPLES):
                db_time = await self.ports.admission.database_time()
                self._db_clock.local(db_time, self._clock.monotonic())
            await self.ports.admission.eligible_scopes("", 1)
            await self.ports.admission.admit({WARM_UP_SCOPE: 1})
            # before the first claim: every hold up to here is one its admissions see
            self._gate.known = await self.ports.holds.latest_hold()
        except Exception as exc:
            # the first rounds then run cold, and holds are learned by the watcher
            if expected(exc):
                log.warning("workers: warm-up skipped: database unavailable or busy")
            else:
                self._errors.caught(Where.WARM_UP, exc)

    async def learn_holds(self) -> None:
        """Learn of the holds placed since the last one learned (hold_watch.py)."""
        await self._hold_watch.learn()

    async def _finish(self, flusher: asyncio.Task[None], listener: asyncio.Task[None],
                      watcher: asyncio.Task[None]) -> None:
        if self._in_flight:
            _, late = await asyncio.wait(list(self._in_flight), timeout=self.grace_seconds)
            # Calls still running after the grace period may have reached the upstream, so
            # their leases are not handed back: they expire and are retried with the same key.
            for pending_call in late:
                pending_call.cancel()
            if late:
                log.warning("calls abandoned at shutdown", extra={"count": len(late)})
                await asyncio.wait(late)
        # let a flush in progress finish: cancelled mid-statement, its outcomes would be
        # lost (the items would wait for their leases to expire and be called again)
        self._flusher_stop.set()
        await asyncio.wait([flusher], timeout=FLUSH_STOP_TIMEOUT_S)
        for helper in (flusher, listener, watcher):
            helper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await helper
        for _ in range(LAST_FLUSH_TRIES):
            if await self.flush(force=True):
                return
            await asyncio.sleep(FLUSH_RETRY_S)
        # given up: these items are called again once their leases expire
        writes = self._writes
        self.unwritten = len(writes.outcomes)
        INTERNAL_ERRORS.labels(Where.SHUTDOWN_FLUSH).inc()
        log.error("shutdown: writes could not be made", extra={
            "where": Where.SHUTDOWN_FLUSH.value, "outcomes": len(writes.outcomes),
            "hand_backs": len(writes.unstarted), "signals": len(writes.signals.buffer)})

    async def _wait_for_slot(self) -> None:
        # woken by each finished call: O(1) per call, where asyncio.wait over every task
        # in flight costs O(concurrency) per round
        while len(self._in_flight) >= self._calls.claimable and not self._stopping.is_set():
            self.turned_at = self._clock.monotonic()  # waiting on calls is not a hang
            self._attempts.slot_freed.clear()
            await self._attempts.slot_freed.wait()

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        if self._stopping.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _flush_loop(self) -> None:
        while not self._flusher_stop.is_set():
            # every FLUSH_INTERVAL_S, or at once when a buffer holds a full batch
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_INTERVAL_S):
                    await self._attempts.flush_now.wait()
            self._attempts.flush_now.clear()
            await self.flush()

    def stop(self) -> None:
        """Stop claiming; calls in flight finish and their outcomes are committed."""
        self._stopping.set()
        self.ready = False
        self._wake.set()
        self._attempts.slot_freed.set()
