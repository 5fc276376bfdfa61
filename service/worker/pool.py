"""The worker pool: claim -> call -> classify -> complete, with bounded concurrency.

One pool per process. Claims are committed before any call starts, no transaction is open
during a call, and outcomes are committed in small groups (one statement per group). Idle
pools wake when items are released and otherwise poll with backoff. Everything outside the
event loop goes through the ports in `ports.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import random
import socket
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Final

from service.budget import answer_effects
from service.budget.rules import Grant, fair_shares, late_tolerance
from service.config.answer_rules import NOTHING_READ, Costs, Reading
from service.config.policies import Policies, Policy
from service.config.policy_file import PolicyConfig
from service.ledger.claims import Lease
from service.ledger.completions import Completion
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
from service.outcomes import (
    NOT_CONFIRMED,
    UNKNOWN_POLICY_VERSION,
    Answer,
    Classified,
    Failure,
    Outcome,
    classify,
    classify_confirmation,
    plan,
)
from service.protocols.transport import SEND_BY, SEND_GATE
from service.upstreams.deletion_api import CallResult
from service.worker.flush_buffer import FlushBuffer
from service.worker.hold_gate import HoldGate
from service.worker.pacing import CallLimit, DatabaseClock, LocalHolds, ScopeCache
from service.worker.pipeline_metrics import PipelineCounts
from service.worker.ports import Ports
from service.worker.signals import SignalBuffer

log = logging.getLogger("service.worker")

IDLE_POLL_MIN_S: Final = 0.05
IDLE_POLL_MAX_S: Final = 2.0
FLUSH_INTERVAL_S: Final = 0.02
FLUSH_STOP_TIMEOUT_S: Final = 5.0  # at shutdown, for a flush in progress to commit
FLUSH_RETRY_S: Final = 0.5  # after a write failed, before that buffer tries again
LAST_FLUSH_TRIES: Final = 50  # at shutdown, FLUSH_RETRY_S apart, before giving up
WRITES_PER_FLUSH: Final = 1_000  # completions (or hand-backs) in one statement
ERROR_BACKOFF_MAX_S: Final = 5.0
FIRST_RETRY_S: Final = 1.0  # between tries of the step before the first claim
# How often a process looks for new legal holds without a notification (a hold placed while
# it holds a covered lease answers within about this long when notifications are lost).
HOLD_POLL_S: Final = 1.0
# At most this many items per admission round. Calls of a round start one after another on
# this event loop, and a token spent more than late_tolerance after its moment goes
# back unspent: large rounds start their last calls late. Smaller rounds also overlap: the
# next round's statements run while this round's calls do.
MAX_ITEMS_PER_ROUND: Final = 64
# Scopes asked for with work: one more than a round can serve. The statement reads every
# open scope whatever the limit, so a longer answer costs only its rows.
SCOPES_ASKED: Final = MAX_ITEMS_PER_ROUND + 1
CLOCK_SAMPLES: Final = 8  # round trips that calibrate the database-clock offset
# A store target's object whose row no longer matched the statement's predicate
SKIPPED: Final = Classified(Outcome.SKIPPED, "predicate_no_longer_holds")
# No real scope can carry this name (scope names have no control characters).
WARM_UP_SCOPE: Final = "\x01warm-up"


# The items of one upstream call: one, or up to a batch policy's max_objects of one scope.
Call = tuple[Lease, ...]


def calls_of(leases: Sequence[Lease], grants: Mapping[str, Grant]) -> list[Call]:
    """Group a round's leases into calls: each alone, except in a scope whose calls carry
    many (its grant's per_call), where they go in order, per_call at most to a call."""
    if all(g.per_call == 1 for g in grants.values()):
        return [(lease,) for lease in leases]
    calls: list[Call] = []
    open_call: dict[str, list[Lease]] = {}
    for lease in leases:
        per_call = grants[lease.scope].per_call
        if per_call == 1:
            calls.append((lease,))
            continue
        group = open_call.setdefault(lease.scope, [])
        group.append(lease)
        if len(group) == per_call:
            calls.append(tuple(group))
            del open_call[lease.scope]
    calls.extend(tuple(group) for group in open_call.values())
    return calls


def _reads(policy: Policy, call: Call) -> bool:
    """Whether `call` is a confirmation read: its one item's deletion answered success and
    its policy confirms deletions (an item whose policy no longer does is deleted again,
    with the same key, and succeeds unconfirmed)."""
    return len(call) == 1 and call[0].confirming and policy.confirm_request is not None


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
        self._rng = rng or random.Random()
        self._clock = ports.clock
        self._in_flight: set[asyncio.Task[None]] = set()
        self._calls = CallLimit(concurrency)
        self._scopes = ScopeCache()
        self._holds = LocalHolds()
        self._errors = InternalErrors(log, self._clock.monotonic)
        self._signals = SignalBuffer(ports.signals, self._errors)
        self._db_clock = DatabaseClock()
        self._cursor = ""
        self._per_call: dict[str, int] = {}  # scopes whose calls carry many items, as granted
        self._slot_freed = asyncio.Event()
        # calls claimed ahead wait here: at most `concurrency` upstream calls at once
        self._slots = asyncio.Semaphore(concurrency)
        self._finished = 0  # calls finished since start
        # completions, hand-backs and scope signals each wait in a buffer of their own,
        # so none holds back another (flush_buffer.py)
        self._done: FlushBuffer[Completion] = FlushBuffer(
            self._complete, max_batch=WRITES_PER_FLUSH, where=Where.COMPLETIONS,
            errors=self._errors, logger=log)
        self._unstarted: FlushBuffer[tuple[Call, LeaseReturn]] = FlushBuffer(
            self._hand_back, max_batch=WRITES_PER_FLUSH, where=Where.HAND_BACK,
            errors=self._errors, logger=log)
        self._flush_now = asyncio.Event()
        self._not_started: dict[asyncio.Task[None], Call] = {}  # created, first step not run
        self.unwritten = 0  # outcomes the last flush at shutdown could not write
        self._counts = PipelineCounts()
        self._wake = asyncio.Event()
        self._gate = HoldGate()  # holds bind at the send (hold_gate.py)
        self._hold_placed = asyncio.Event()
        self._retry_at: dict[Where, float] = {}  # a failed buffer's next try (monotonic)
        self._unacked: dict[int, list[int]] = {}  # revoked calls by hold, not yet acknowledged
        self._stopping = asyncio.Event()
        self._flusher_stop = asyncio.Event()
        self.token_wait: float | None = None
        # the probes' view (service/worker/health.py): when the loop last turned, and
        # whether it is warmed up and not stopping
        self.turned_at = self._clock.monotonic()
        self.ready = False
        self.completed = 0
        self.fenced = 0
        self.reclaimed = 0

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
        admission = self.ports.admission
        finished_before = self._finished
        scopes = self._scopes.known(self._cursor, self._clock.monotonic())
        if scopes is None:
            # a shorter answer than asked lists every scope with work, which the next
            # rounds take in turn without asking again
            scopes = await admission.eligible_scopes(self._cursor, SCOPES_ASKED)
            self._scopes.found(scopes, SCOPES_ASKED, self._clock.monotonic())
        scopes = self._holds.without_held(scopes, self._clock.monotonic())[:free]
        if not scopes:
            return 0
        self._cursor = scopes[-1][0]
        # a round claims at most MAX_ITEMS_PER_ROUND items: a scope whose calls carry many
        # (a batch policy's, a store target's) asks for that many items' worth of calls,
        # at least one, so its claim answers within its tokens' lateness
        wants = {scope: min(n, max(1, MAX_ITEMS_PER_ROUND // self._per_call.get(scope, 1)))
                 for scope, n in fair_shares(scopes, free).items()}
        sent = self._clock.monotonic()
        admitted = await admission.admit(wants)
        self._calls.claim_answered(self._finished - finished_before)
        self._scopes.admitted(admitted, wants)
        received = self._clock.monotonic()
        leases = admitted.leases
        by_scope = {g.scope: g for g in admitted.grants}
        self._per_call.update((g.scope, g.per_call) for g in admitted.grants
                              if g.per_call > 1 or g.scope in self._per_call)
        calls = calls_of(leases, by_scope)
        granted = sum(g.granted for g in admitted.grants)
        TOKENS_GRANTED.inc(granted)
        if granted - len(calls):
            TOKENS_RETURNED.inc(granted - len(calls))
        if not granted:
            waits = [g.wait_seconds for g in admitted.grants]
            if waits:  # scopes with work, open, and no token for any of them
                LIMITER_WAITS.inc()
                self.token_wait = min(waits)
            return 0
        if not leases:
            return 0
        self.reclaimed += self._counts.claimed(leases)
        if self._stopping.is_set():
            # stop() arrived while the claim was committing: nothing was called yet, so the
            # leases and their tokens go back without counting an attempt
            self._unstarted.add((c, LeaseReturn.SHUTDOWN) for c in calls)
            await self._unstarted.flush()
            return 0
        position: Counter[str] = Counter()
        # the local moment of each grant, on this process's calibrated database clock
        granted_at = {g.scope: self._db_clock.local(g.schedule_start, received)
                      for g in admitted.grants if g.granted}
        self._gate.leased(((lease, self._db_clock.to_local(lease.lease_expires_at.timestamp()))
                           for lease in leases), sent)
        IN_FLIGHT.inc(len(calls))
        for call in calls:
            # each call is made when its token is due on the database's schedule (at most
            # the lookahead from now); a token whose moment passed long ago (a slow claim)
            # is handed back rather than spent late, where it would crowd the next ones
            scope = call[0].scope
            grant = by_scope[scope]
            due = granted_at[scope] + grant.due_in(position[scope])
            position[scope] += 1
            give_up = due + late_tolerance(grant.rate)
            task = asyncio.create_task(self._attempt(call, due, give_up, round_no))
            self._in_flight.add(task)
            self._not_started[task] = call
            task.add_done_callback(self._call_done)
        return len(leases)

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._finished += 1
        self._slot_freed.set()
        call = self._not_started.pop(task, None)
        if call is not None:
            # cancelled before its first step, so `_attempt`'s own cleanup never ran: the
            # call was not made, its lease goes back and it leaves the in-flight gauge
            log.warning("call cancelled before it started; its lease goes back",
                        extra={"items": len(call)})
            self._gate.finished(call)
            IN_FLIGHT.dec()
            self._unstarted.add([(call, LeaseReturn.SHUTDOWN)])

    async def _hand_back(self, calls: list[tuple[Call, LeaseReturn]]) -> None:
        """Return the leases of calls that were never made, without an attempt, in one
        statement for the whole list (under CPU starvation whole rounds come due late), and
        the token of each, except a late one: refunded, the refill it stood for would be
        granted again beside the tokens due after it, and a second could exceed rate +
        burst (at a start, the refill from the first grant to the first call)."""
        leases = [lease for call, _ in calls for lease in call]
        tokens = [1 if i == 0 and reason not in (LeaseReturn.LATE_START,
                                                 LeaseReturn.LEASE_ENDING) else 0
                  for call, reason in calls for i in range(len(call))]
        await self.ports.completion.hand_back(leases, tokens)
        reasons: Counter[LeaseReturn] = Counter()
        for call, reason in calls:
            reasons[reason] += len(call)
        self._counts.returned(reasons, tokens=sum(tokens))

    async def drain(self) -> bool:
        """Wait for every call in flight and commit their outcomes; whether all were."""
        if self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)
        return await self.flush(force=True)

    async def flush(self, force: bool = False) -> bool:
        """Commit the outcomes gathered so far first, then hand back leases that were never
        called, then apply scope signals: each in its own statements, a failure of one
        never keeping the others back, and what fails kept for the next flush. A buffer
        whose write failed rests FLUSH_RETRY_S unless `force`. True when all are written."""
        written = True
        for buffer in (self._done, self._unstarted, self._signals.buffer):
            if force or self._clock.monotonic() >= self._retry_at.get(buffer.where, 0.0):
                if await buffer.flush():
                    self._retry_at.pop(buffer.where, None)
                else:
                    self._retry_at[buffer.where] = self._clock.monotonic() + FLUSH_RETRY_S
            written = written and not len(buffer)
        return written

    async def _complete(self, batch: list[Completion]) -> None:
        fenced = await self.ports.completion.complete(batch)
        self.completed += len(batch) - len(fenced)
        self.fenced += len(fenced)
        self._counts.completed(batch, set(fenced))

    # -- one attempt -----------------------------------------------------------------

    async def _attempt(self, call: Call, due: float = 0.0, give_up: float = math.inf,
                       round_no: int = 0) -> None:
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
                self._unstarted.add([(call, LeaseReturn.SHUTDOWN)])
                raise
            try:
                unstarted = (LeaseReturn.SHUTDOWN if self._stopping.is_set()
                             else LeaseReturn.SCOPE_HELD if lease.scope in self._holds
                             else LeaseReturn.LATE_START if clock.monotonic() > give_up
                             else None)
                if unstarted is not None:
                    self._not_made(call, unstarted, round_no)
                    return
                policy = self.policies.policy(lease.policy)
                started = clock.now()
                if policy is None or policy.version != lease.policy_version:
                    result = CallResult(Answer(failure=Failure.INVALID_REQUEST), 0.0)
                    reason_override: str | None = UNKNOWN_POLICY_VERSION
                else:
                    reason_override = None
                    # lateness counts until the request is written: taking or opening a
                    # connection can outlast the tolerance (service/protocols/transport.py)
                    send_by = SEND_BY.set(give_up if give_up < math.inf else None)
                    send_gate = SEND_GATE.set(self._gate.gate(call, clock.monotonic))
                    try:
                        result = await self._call(policy, call)
                    finally:
                        SEND_GATE.reset(send_gate)
                        SEND_BY.reset(send_by)
                    if result.answer.failure is Failure.SENT_TOO_LATE:
                        self._not_made(call, LeaseReturn.LATE_START, round_no)
                        return
                    if result.answer.failure is Failure.WITHHELD:
                        self._not_made(call, LeaseReturn.HELD if self._gate.revoked(call)
                                       else LeaseReturn.LEASE_ENDING, round_no)
                        return
            finally:
                self._slots.release()
            self._done.add(self._completions(call, policy, result, started, reason_override))
            if self._done.full:
                self._flush_now.set()
            if self._signals.urgent:
                # a throttle or credential signal acts now, not at the next flush: every
                # replica's next admission round must already see the scope closed (what
                # fails waits for the next flush, and is counted)
                await self._signals.flush(Where.URGENT_SIGNALS)
        finally:
            self._gate.finished(call)
            IN_FLIGHT.dec()

    def _not_made(self, call: Call, reason: LeaseReturn, round_no: int) -> None:
        """A call not made: its leases go back with the next flush (one statement for all
        of them, `_hand_back`), no attempt counted; a late one also tells the round."""
        if reason is LeaseReturn.LATE_START:
            self._calls.started_late(round_no)
        self._unstarted.add([(call, reason)])

    async def _call(self, policy: Policy, call: Call) -> CallResult:
        lease = call[0]
        try:
            if _reads(policy, call):
                return await self.ports.calls.confirm(policy, lease)
            return await (self.ports.calls.delete(policy, lease) if len(call) == 1
                          and policy.per_call == 1 and policy.config.target is None
                          else self.ports.calls.delete_batch(policy, call))
        except Exception as exc:
            # A bug or an unforeseen client error must still end in an outcome; the request
            # may have been sent, so it is `unknown` (the same key next time).
            self._errors.caught(Where.CALL, exc, policy=policy.name)
            return CallResult(Answer(failure=Failure.PROTOCOL), 0.0)

    def _completions(self, call: Call, policy: Policy | None, result: CallResult,
                     started: datetime, reason_override: str | None) -> list[Completion]:
        """The outcome of one call for each of its items: classified once, its scope
        effects noted once, and each item planned by its own attempt count (an object the
        answer names as failed is retried alone, as a transient)."""
        finished = self._clock.now()
        lease = call[0]
        cfg = policy.config if policy is not None else None
        answer = result.answer
        if policy is not None and reason_override is None and _reads(policy, call):
            return [self._confirmation(lease, policy, result, started, finished)]
        reading = NOTHING_READ
        if result.rows is not None:
            reading = Reading(None, Costs(actual=result.rows, available=None))
        elif policy is not None and reason_override is None and answer.status is not None \
                and not policy.answers.reads_nothing:
            try:
                reading = policy.answers.read(answer.status, answer.body)
            except Exception as exc:
                # an answer the rules cannot read is read by its status alone: a hostile
                # body must never leave an item without an outcome
                self._errors.caught(Where.ANSWER_RULES, exc, policy=policy.name)
        ruled = reading.verdict
        if ruled is not None and ruled.version is not None and ruled.version == (
                lease.object_version or (cfg.initial_object_version if cfg else None)):
            # the conflict named the version just sent (a concurrent writer): retrying at
            # once would spend the attempts in seconds, so it backs off like any transient
            ruled = Classified(ruled.outcome, ruled.reason + ":same_version")
        verdict = result.verdict or classify(
            answer, now=finished, ruled=ruled,
            absent_means_deleted=bool(cfg and cfg.absent_means_deleted))
        if cfg is not None and reason_override is None:
            effects = answer_effects.effects_of(verdict, answer, cfg, finished, reading.costs)
            self._signals.note(lease.scope, effects)
            if effects.hold_seconds is not None:
                self._holds.hold(lease.scope, self._clock.monotonic() + effects.hold_seconds)
        failed = reading.failed if verdict.outcome is Outcome.SUCCEEDED else None
        own = result.verdicts
        # a deletion that answered success on an item whose policy confirms it goes back
        # pending, to be claimed again (budget, lease, holds, send gate and all) for its read
        confirms = policy is not None and reason_override is None and len(call) == 1 \
            and policy.confirm_request is not None and policy.confirms(lease.operation_key)
        return [self._completion(each, cfg, result, own.get(each.object_id) or (
                                 SKIPPED if each.object_id in result.skipped else verdict),
                                 started, finished, reason_override, failed, confirms)
                for each in call]

    def _confirmation(self, lease: Lease, policy: Policy, result: CallResult,
                      started: datetime, finished: datetime) -> Completion:
        """The outcome of a confirmation read: succeeded (confirmed) when it found the
        object absent; a deletion again, with the same key, when it found the object served
        (`not_confirmed`, an attempt counted); the read again after a failure of its own.
        Its answer acts on the scope as a deletion's would (a 429 closes it)."""
        cfg = policy.config
        confirm = cfg.confirm
        absent = confirm.absent if confirm is not None else ()
        verdict = classify_confirmation(result.answer, absent=absent, now=finished)
        effects = answer_effects.effects_of(verdict, result.answer, cfg, finished)
        self._signals.note(lease.scope, effects)
        if effects.hold_seconds is not None:
            self._holds.hold(lease.scope, self._clock.monotonic() + effects.hold_seconds)
        done = self._completion(lease, cfg, result, verdict, started, finished, None, None,
                                False)
        confirmed = verdict.outcome is Outcome.SUCCEEDED
        again = done.status == "pending" and verdict.reason != NOT_CONFIRMED
        return dataclasses.replace(done, confirmed=confirmed, to_confirm=again)

    def _completion(self, lease: Lease, cfg: PolicyConfig | None, result: CallResult,
                    verdict: Classified, started: datetime, finished: datetime,
                    reason_override: str | None, failed: frozenset[str] | None,
                    confirms: bool = False) -> Completion:
        if failed and lease.object_id in failed:
            verdict = Classified(Outcome.TRANSIENT, verdict.reason + ":object_failed")
        if cfg is None or reason_override is not None:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=1, backoff_base_s=1,
                             backoff_max_s=1, retry_after_max_s=1, jitter=0)
        else:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=cfg.max_attempts,
                             backoff_base_s=cfg.backoff.base_seconds,
                             backoff_max_s=cfg.backoff.max_seconds,
                             retry_after_max_s=cfg.retry_after_max_seconds,
                             jitter=self._rng.random())
        to_confirm = confirms and next_step.status == "succeeded"
        if to_confirm:
            # not succeeded until a read finds the object gone: pending at once, and the
            # attempt given back, so an attempt is one deletion and its read together
            next_step = dataclasses.replace(next_step, status="pending", retry_in_seconds=0.0,
                                            refund_attempt=True)
        # successes are the bulk: DEBUG; anything else is worth a line at INFO
        level = logging.DEBUG if verdict.outcome is Outcome.SUCCEEDED else logging.INFO
        if log.isEnabledFor(level):  # the extra dict is built only for a line written
            log.log(level, "attempt", extra={
                "item_id": lease.item_id, "operation_key": lease.operation_key,
                "policy": lease.policy, "scope": lease.scope, "outcome": verdict.outcome.value,
                "http_status": result.answer.status, "attempt": lease.attempt})
        return Completion(
            lease=lease, worker=self.name, outcome=verdict.outcome.value,
            status=next_step.status, reason=reason_override or next_step.reason,
            http_status=result.answer.status,
            retry_after_seconds=(verdict.retry_after_seconds
                                 if verdict.outcome is Outcome.THROTTLED else None),
            retry_in_seconds=next_step.retry_in_seconds, refund_attempt=next_step.refund_attempt,
            started_at=started, finished_at=finished, latency_ms=result.latency_ms,
            object_version=verdict.version, to_confirm=to_confirm)

    # -- the loop --------------------------------------------------------------------

    async def run(self, *, first: Callable[[], Awaitable[object]] | None = None) -> None:
        """Claim, call and complete until stop(); survives database outages. `first` runs
        before the first claim, tried again every FIRST_RETRY_S until it succeeds."""
        while first is not None and not self._stopping.is_set():
            self.turned_at = self._clock.monotonic()
            try:
                await first()
                break
            except Exception as exc:
                if expected(exc):
                    log.warning("workers: waiting for the database before the first claim")
                else:
                    self._errors.caught(Where.FIRST_STEP, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_RETRY_S):
                    await self._stopping.wait()
        async with self.ports.hold():
            await self._warm_up()
            listener = asyncio.create_task(self.ports.wakeups.listen(
                self._wake.set, self._hold_placed.set))
            flusher = asyncio.create_task(self._flush_loop())
            watcher = asyncio.create_task(self._watch_holds())
            self.ready = True
            try:
                await self._loop()
            finally:
                self.ready = False
                await self._finish(flusher, listener, watcher)

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

    # -- legal holds (hold_gate.py) ----------------------------------------------------

    async def learn_holds(self) -> None:
        """Learn of the holds placed since the last one learned: revoke the calls they
        cover that have not started, then acknowledge them (with those calls)."""
        latest = await self.ports.holds.latest_hold()
        known = self._gate.known
        if known is None or latest > known:
            # not read at the start (the database was away): every hold in force
            covers = await self.ports.holds.holds_since(known or 0)
            for hold_id, revoked in self._gate.learn(covers, self._clock.monotonic()).items():
                self._unacked.setdefault(hold_id, []).extend(revoked)
        if self._unacked:
            await self.ports.holds.acknowledge(self._unacked)
            self._unacked = {}
        self._gate.known = max(latest, known or 0)

    async def _watch_holds(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_POLL_S):
                    await self._hold_placed.wait()
            self._hold_placed.clear()
            try:
                await self.learn_holds()
            except Exception as exc:
                if expected(exc):
                    log.warning("workers: holds could not be read; trying again")
                else:
                    self._errors.caught(Where.HOLDS_WATCH, exc)

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
        self.unwritten = len(self._done)
        INTERNAL_ERRORS.labels(Where.SHUTDOWN_FLUSH).inc()
        log.error("shutdown: writes could not be made", extra={
            "where": Where.SHUTDOWN_FLUSH.value, "outcomes": len(self._done),
            "hand_backs": len(self._unstarted), "signals": len(self._signals.buffer)})

    async def _wait_for_slot(self) -> None:
        # woken by each finished call: O(1) per call, where asyncio.wait over every task
        # in flight costs O(concurrency) per round
        while len(self._in_flight) >= self._calls.claimable and not self._stopping.is_set():
            self.turned_at = self._clock.monotonic()  # waiting on calls is not a hang
            self._slot_freed.clear()
            await self._slot_freed.wait()

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
                    await self._flush_now.wait()
            self._flush_now.clear()
            await self.flush()

    def stop(self) -> None:
        """Stop claiming; calls in flight finish and their outcomes are committed."""
        self._stopping.set()
        self.ready = False
        self._wake.set()
        self._slot_freed.set()
