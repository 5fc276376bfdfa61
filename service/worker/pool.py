"""The worker pool: claim -> call -> classify -> complete, with bounded concurrency.

One pool per process. Claims are committed before any call starts, no transaction is open
during a call, and outcomes are committed in small groups (one statement per group). Idle
pools wake on LISTEN/NOTIFY when items are released and otherwise poll with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from service import claims, limiter
from service.claims import Completion, Lease
from service.db.engine import is_unavailable, make_engine
from service.db.statements import Database, HeldConnection
from service.metrics import (
    IN_FLIGHT,
    LIMITER_WAITS,
    SCOPE_SIGNALS,
    TOKENS_GRANTED,
    TOKENS_RETURNED,
    LeaseReturn,
    ScopeSignal,
    initialise_series,
)
from service.outcomes import (
    UNKNOWN_POLICY_VERSION,
    Answer,
    Classified,
    Failure,
    Outcome,
    classify,
    plan,
)
from service.pipeline_counts import PipelineCounts
from service.policies import Policies, Policy
from service.settings import Settings
from service.upstream import CallResult, Upstreams

log = logging.getLogger(__name__)

IDLE_POLL_MIN_S: Final = 0.05
IDLE_POLL_MAX_S: Final = 2.0
FLUSH_INTERVAL_S: Final = 0.02
FLUSH_STOP_TIMEOUT_S: Final = 5.0  # at shutdown, for a flush in progress to commit
ERROR_BACKOFF_MAX_S: Final = 5.0
LISTEN_PROBE_INTERVAL_S: Final = 10.0
# How long a scope this process saw throttled (without a date) or refused is held locally
# until the database closure or pause, which every replica obeys, is certainly in place.
LOCAL_HOLD_S: Final = 1.0
# At most this many items per admission round. Calls of a round start one after another on
# this event loop, and a token spent more than limiter.late_tolerance after its moment goes
# back unspent: rounds of 180 items (concurrency 256) handed back over half of what they
# claimed, only to claim it again. Smaller rounds also overlap: the next round's statements
# run while this round's calls do.
MAX_ITEMS_PER_ROUND: Final = 64
# When calls start so late that their tokens go back (this event loop is congested: many
# answers to process, or too little CPU), the calls allowed in flight are halved, at most
# once per round, and grow back by one per round without a late start. Without this, a
# loopback drain at concurrency 256 claimed 88,634 leases for 20,000 items.
MIN_CALLS_IN_FLIGHT: Final = 8
# How long the scopes found with work may be served again without asking which scopes have
# work (one round trip a round saved): a scope that gains work meanwhile waits this long.
ELIGIBLE_REUSE_S: Final = 0.1
CLOCK_SAMPLES: Final = 8  # round trips that calibrate the database-clock offset
# No real scope can carry this name (scope names have no control characters).
WARM_UP_SCOPE: Final = "\x01warm-up"


class DatabaseClock:
    """Maps the database's clock onto this process's monotonic clock, so every replica
    spends its tokens on the database's schedule. The offset is the smallest seen of
    (local receipt - database time): one slow answer does not shift the schedule later,
    and the estimate is never early (it includes at least the fastest one-way delay)."""

    DRIFT_ALLOWANCE_S_PER_S: Final = 0.0001

    def __init__(self) -> None:
        self._offset: float | None = None
        self._at = 0.0

    def local(self, db_time: float, received: float) -> float:
        """The local monotonic moment of `db_time`, given it was received at `received`."""
        sample = received - db_time
        if self._offset is None:
            self._offset = sample
        else:
            # let the estimate creep up slowly so clock drift cannot pin it too low
            aged = self._offset + (received - self._at) * self.DRIFT_ALLOWANCE_S_PER_S
            self._offset = min(aged, sample)
        self._at = received
        return db_time + self._offset


def worker_name() -> str:
    """A name unique to this process, recorded as lease owner and in attempts."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class WorkerPool:
    """Runs up to `concurrency` upstream calls at once. `run_once()` does one claim round
    (tests drive it directly); `run()` loops until `stop()`."""

    def __init__(self, engine: AsyncEngine, policies: Policies, upstreams: Upstreams, *,
                 concurrency: int, listen_url: str | None = None, grace_seconds: float = 20.0,
                 name: str | None = None, rng: random.Random | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.engine = engine
        self.policies = policies
        self.upstreams = upstreams
        self.concurrency = concurrency
        self.name = name or worker_name()
        self.listen_url = listen_url
        self.grace_seconds = grace_seconds
        self._rng = rng or random.Random()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._limit = concurrency  # calls allowed in flight now (see MIN_CALLS_IN_FLIGHT)
        self._round = 0
        self._late_round = 0  # the latest round whose call started too late
        self._slowed_round = 0  # the round at which the limit was last halved
        self._slot_freed = asyncio.Event()
        self._done: list[Completion] = []
        self._unstarted: list[tuple[Lease, LeaseReturn]] = []
        # held only while run() is active: one for admission rounds, one for completions
        self._admission: HeldConnection | None = None
        self._completing: HeldConnection | None = None
        self._counts = PipelineCounts()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._flusher_stop = asyncio.Event()
        self._lease_seconds = {n: p.config.lease_seconds for n, p in policies.policies.items()}
        self._max_attempts = {n: p.config.max_attempts for n, p in policies.policies.items()}
        self._cursor = ""
        self._eligible: list[tuple[str, int]] = []
        self._eligible_at = 0.0
        self._closures: dict[str, limiter.Closure] = {}
        self._pauses: set[str] = set()
        self._recovered: set[str] = set()
        self._held_locally: dict[str, float] = {}
        self._backed_off: set[str] = set()
        self._clock = DatabaseClock()
        self.token_wait: float | None = None
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
        self._round += 1
        if self._late_round > self._slowed_round:
            self._limit = max(min(MIN_CALLS_IN_FLIGHT, self.concurrency), self._limit // 2)
            self._slowed_round = self._round
        elif self._limit < self.concurrency:
            self._limit += 1
        free = min(MAX_ITEMS_PER_ROUND, self._limit - len(self._in_flight))
        if free <= 0:
            return 0
        async with self._on(self._admission) as db:
            scopes = self._known_scopes(free)
            if scopes is None:
                scopes = await limiter.eligible_scopes(db, cursor=self._cursor, limit=free)
                # every scope with work fits in this round: the list can serve the next
                # rounds too (each scope keeps its fair share) until a scope runs dry
                self._eligible = list(scopes) if len(scopes) < free else []
                self._eligible_at = time.monotonic()
            if self._held_locally:
                # this process heard the 429/401 itself: hold the scope without waiting for
                # the database round trip that tells every other replica
                now = time.monotonic()
                self._held_locally = {s: t for s, t in self._held_locally.items() if t > now}
                scopes = [(s, w) for s, w in scopes if s not in self._held_locally]
            if not scopes:
                return 0
            self._cursor = scopes[-1][0]
            admitted = await claims.admit(db, owner=self.name,
                                          wants=limiter.fair_shares(scopes, free),
                                          lease_seconds=self._lease_seconds,
                                          max_attempts=self._max_attempts)
        self._forget_dry_scopes(admitted)
        received = time.monotonic()
        leases = admitted.leases
        granted = sum(g.granted for g in admitted.grants)
        TOKENS_GRANTED.inc(granted)
        if granted - len(leases):
            TOKENS_RETURNED.inc(granted - len(leases))
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
            # leases and their tokens go straight back without counting an attempt
            await self._hand_back(leases, {LeaseReturn.SHUTDOWN: len(leases)})
            return 0
        by_scope = {g.scope: g for g in admitted.grants}
        position: Counter[str] = Counter()
        # the local moment of each grant, on this process's calibrated database clock
        granted_at = {g.scope: self._clock.local(g.granted_at, received)
                      for g in admitted.grants if g.granted}
        IN_FLIGHT.inc(len(leases))
        for lease in leases:
            # each item is called when its token is due on the database's schedule (at most
            # the lookahead from now); a token whose moment passed long ago (a slow claim)
            # is handed back rather than spent late, where it would crowd the next ones
            grant = by_scope[lease.scope]
            due = granted_at[lease.scope] + grant.due_in(position[lease.scope])
            position[lease.scope] += 1
            give_up = due + limiter.late_tolerance(grant.rate)
            task = asyncio.create_task(self._attempt(lease, due, give_up, self._round))
            self._in_flight.add(task)
            task.add_done_callback(self._call_done)
        return len(leases)

    def _known_scopes(self, free: int) -> list[tuple[str, int]] | None:
        """The scopes of an earlier round, while they are all still known to have work and
        none can have been missed for long; None when they must be read again."""
        if (not self._eligible or len(self._eligible) >= free
                or time.monotonic() - self._eligible_at > ELIGIBLE_REUSE_S):
            return None
        return self._eligible

    def _forget_dry_scopes(self, admitted: claims.Admission) -> None:
        if not self._eligible:
            return
        used = Counter(lease.scope for lease in admitted.leases)
        granted = {g.scope: g.granted for g in admitted.grants}
        # a scope that is closed or paused (no grant row) or had fewer items than tokens
        # is read again with the others; one that only lacked tokens still has work
        if any(scope not in granted or used[scope] < granted[scope]
               for scope, _ in self._eligible):
            self._eligible = []

    def _call_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._slot_freed.set()

    async def _hand_back(self, leases: list[Lease], reasons: Mapping[LeaseReturn, int]
                         ) -> None:
        """Return leases that were never called, and their tokens, without an attempt, in
        one statement for the whole list (under CPU starvation whole rounds come due late)."""
        async with self._on(self._completing) as db:
            await claims.hand_back(db, leases)
        self._counts.returned(reasons)

    @contextlib.asynccontextmanager
    async def _on(self, held: HeldConnection | None) -> AsyncIterator[Database]:
        """The held connection while `run()` is active, else the engine (tests drive
        `run_once()` and `flush()` without a loop)."""
        if held is None:
            yield self.engine
        else:
            async with held.use() as conn:
                yield conn

    async def drain(self) -> None:
        """Wait for every call in flight and commit their outcomes."""
        if self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)
        await self.flush()

    async def flush(self) -> None:
        """Commit the outcomes gathered so far (one statement), then count them; hand back
        leases that were never called."""
        await self._apply_scope_signals()
        unstarted, self._unstarted = self._unstarted, []
        if unstarted:
            try:
                await self._hand_back([lease for lease, _ in unstarted],
                                      Counter(reason for _, reason in unstarted))
            except Exception:
                self._unstarted = unstarted + self._unstarted
                raise
        batch, self._done = self._done, []
        if not batch:
            return
        try:
            async with self._on(self._completing) as db:
                fenced = await claims.complete(db, batch)
        except Exception:
            self._done = batch + self._done  # keep them; the next flush retries
            raise
        self.completed += len(batch) - len(fenced)
        self.fenced += len(fenced)
        self._counts.completed(batch, set(fenced))

    async def _apply_scope_signals(self) -> None:
        closures, self._closures = self._closures, {}
        pauses, self._pauses = self._pauses, set()
        recovered, self._recovered = self._recovered - set(closures) - pauses, set()
        try:
            await limiter.close(self.engine, closures, self._rng)
            for scope in await limiter.pause(self.engine, sorted(pauses), "unauthorized"):
                log.warning("scope paused: the upstream refused our credentials",
                            extra={"scope": scope})
            await limiter.recovered(self.engine, sorted(recovered))
        except Exception:
            # keep them for the next flush (a closure must not be lost to an outage)
            for scope, closure in closures.items():
                self._closures.setdefault(scope, closure)
            self._pauses |= pauses
            raise

    def _note_signal(self, lease: Lease, policy: Policy | None, verdict: Classified,
                     answer: Answer) -> None:
        cfg = policy.config if policy is not None else None
        if cfg is None:
            return
        delay = None
        if verdict.outcome is Outcome.THROTTLED:
            delay = verdict.retry_after_seconds
            if delay is not None:
                delay = min(delay, cfg.retry_after_max_seconds)
            self._add_closure(lease.scope, delay, cfg.backoff.base_seconds,
                              cfg.backoff.max_seconds)
            SCOPE_SIGNALS.labels(ScopeSignal.THROTTLED).inc()
            if delay is None:
                self._backed_off.add(lease.scope)
            self._held_locally[lease.scope] = time.monotonic() + (
                delay if delay is not None else min(LOCAL_HOLD_S, cfg.backoff.base_seconds))
        elif verdict.outcome is Outcome.UNAUTHORIZED:
            SCOPE_SIGNALS.labels(ScopeSignal.UNAUTHORIZED).inc()
            self._pauses.add(lease.scope)
            self._held_locally[lease.scope] = time.monotonic() + LOCAL_HOLD_S
        elif verdict.outcome is Outcome.SUCCEEDED and lease.scope in self._backed_off:
            # only scopes this process saw back off need their level reset
            self._backed_off.discard(lease.scope)
            self._recovered.add(lease.scope)
        if answer.quota_reset_seconds is not None and answer.quota_reset_seconds > 0:
            # the upstream says the quota is spent: slow down before it answers 429. A reset
            # due now names no wait, and must not displace a throttle's backoff closure.
            SCOPE_SIGNALS.labels(ScopeSignal.QUOTA_EXHAUSTED).inc()
            self._add_closure(lease.scope, min(answer.quota_reset_seconds,
                                               cfg.retry_after_max_seconds),
                              cfg.backoff.base_seconds, cfg.backoff.max_seconds)

    def _add_closure(self, scope: str, delay: float | None, base: float, max_s: float
                     ) -> None:
        # one closure per scope per flush: the longest delay the upstream named wins over
        # a shorter one and over the scope's own backoff
        known = self._closures.get(scope)
        if known is None or (delay is not None and (known.delay_seconds is None
                                                    or delay > known.delay_seconds)):
            self._closures[scope] = limiter.Closure(delay, base, max_s)

    # -- one attempt -----------------------------------------------------------------

    async def _attempt(self, lease: Lease, due: float = 0.0, give_up: float = math.inf,
                       round_no: int = 0) -> None:
        try:
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            unstarted = (LeaseReturn.SHUTDOWN if self._stopping.is_set()
                         else LeaseReturn.SCOPE_HELD if lease.scope in self._held_locally
                         else LeaseReturn.LATE_START if time.monotonic() > give_up else None)
            if unstarted is LeaseReturn.LATE_START:
                self._late_round = max(self._late_round, round_no)
            if unstarted is not None:
                # not called: the lease and its token go back with the next flush (one
                # statement for all of them), no attempt counted
                self._unstarted.append((lease, unstarted))
                return
            policy = self.policies.policy(lease.policy)
            started = datetime.now(UTC)
            if policy is None or policy.version != lease.policy_version:
                result = CallResult(Answer(failure=Failure.INVALID_REQUEST), 0.0)
                reason_override: str | None = UNKNOWN_POLICY_VERSION
            else:
                reason_override = None
                try:
                    result = await self.upstreams.for_policy(policy).delete(
                        policy, tenant_id=lease.tenant_id, object_id=lease.object_id,
                        operation_key=lease.operation_key)
                except Exception:
                    # A bug or an unforeseen client error must still end in an outcome; the
                    # request may have been sent, so it is `unknown` (same key next time).
                    log.exception("upstream call crashed", extra={"item_id": lease.item_id})
                    result = CallResult(Answer(failure=Failure.PROTOCOL), 0.0)
            self._done.append(self._completion(lease, policy, result, started, reason_override))
            if self._closures or self._pauses:
                # a throttle or credential signal acts now, not at the next flush: every
                # replica's next admission round must already see the scope closed
                with contextlib.suppress(Exception):
                    await self._apply_scope_signals()
        finally:
            IN_FLIGHT.dec()

    def _completion(self, lease: Lease, policy: Policy | None, result: CallResult,
                    started: datetime, reason_override: str | None) -> Completion:
        finished = datetime.now(UTC)
        cfg = policy.config if policy is not None else None
        verdict = classify(result.answer, now=finished,
                           absent_means_deleted=bool(cfg and cfg.absent_means_deleted))
        if cfg is None or reason_override is not None:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=1, backoff_base_s=1,
                             backoff_max_s=1, retry_after_max_s=1, jitter=0)
        else:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=cfg.max_attempts,
                             backoff_base_s=cfg.backoff.base_seconds,
                             backoff_max_s=cfg.backoff.max_seconds,
                             retry_after_max_s=cfg.retry_after_max_seconds,
                             jitter=self._rng.random())
        self._note_signal(lease, policy, verdict, result.answer)
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
            started_at=started, finished_at=finished, latency_ms=result.latency_ms)

    # -- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        """Claim, call and complete until stop(); survives database outages."""
        self._admission = HeldConnection(self.engine)
        self._completing = HeldConnection(self.engine)
        await self._warm_up()
        listener = asyncio.create_task(self._listen()) if self.listen_url else None
        flusher = asyncio.create_task(self._flush_loop())
        idle = IDLE_POLL_MIN_S
        error_backoff = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    claimed = await self.run_once()
                    error_backoff = 0.1
                except Exception as exc:
                    if not is_unavailable(exc):
                        log.exception("claim failed")
                    else:
                        log.warning("database unavailable; claims paused",
                                    extra={"retry_in_s": error_backoff})
                    await self._sleep(error_backoff)
                    error_backoff = min(ERROR_BACKOFF_MAX_S, error_backoff * 2)
                    continue
                if claimed:
                    idle = IDLE_POLL_MIN_S
                    if len(self._in_flight) >= self._limit:
                        await self._wait_for_slot()
                    continue
                if self.token_wait is not None:
                    # budget-bound: sleep until the next token, not a poll interval
                    await self._sleep(min(max(self.token_wait, 0.001), IDLE_POLL_MAX_S))
                    continue
                await self._sleep(idle)
                idle = min(IDLE_POLL_MAX_S, idle * 2)
        finally:
            await self._finish(flusher, listener)

    async def _warm_up(self) -> None:
        """Prepare the admission statements on a pooled connection, and the HTTP client,
        before the first token is taken: a cold first claim or first call made this process
        spend its first tokens late."""
        with contextlib.suppress(Exception):
            await self.upstreams.warm_up()
        with contextlib.suppress(Exception):
            # calibrate the database-clock offset before the first grant: a first sample
            # taken on a cold connection would place this process's first calls late
            for _ in range(CLOCK_SAMPLES):
                db_time = await limiter.database_time(self.engine)
                self._clock.local(db_time, time.monotonic())
            async with self._on(self._admission) as db:
                await limiter.eligible_scopes(db, cursor="", limit=1)
                await claims.admit(db, owner=self.name, wants={WARM_UP_SCOPE: 1},
                                   lease_seconds=self._lease_seconds)

    async def _finish(self, flusher: asyncio.Task[None], listener: asyncio.Task[None] | None
                      ) -> None:
        if self._in_flight:
            _, late = await asyncio.wait(list(self._in_flight), timeout=self.grace_seconds)
            # Calls still running after the grace period may have reached the upstream, so
            # their leases are not handed back: they expire and are retried with the same key.
            for pending_call in late:
                pending_call.cancel()
            if late:
                log.warning("calls abandoned at shutdown", extra={"count": len(late)})
                await asyncio.wait(late)
        # let a flush in progress finish: cancelled mid-statement, its outcomes were lost
        # (the items then waited for their leases to expire and were called again)
        self._flusher_stop.set()
        await asyncio.wait([flusher], timeout=FLUSH_STOP_TIMEOUT_S)
        flusher.cancel()
        if listener is not None:
            listener.cancel()
        for helper in (flusher, listener):
            if helper is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
        try:
            for _ in range(50):
                try:
                    await self.flush()
                    return
                except Exception as exc:
                    if not is_unavailable(exc):
                        raise
                    await asyncio.sleep(0.2)
        finally:
            for held in (self._admission, self._completing):
                if held is not None:
                    await held.close()
            self._admission = self._completing = None

    async def _wait_for_slot(self) -> None:
        # woken by each finished call: O(1) per call, where asyncio.wait over every task
        # in flight cost O(concurrency) per round
        while len(self._in_flight) >= self._limit and not self._stopping.is_set():
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
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                await self.flush()
            except Exception as exc:
                if not is_unavailable(exc):
                    log.exception("completion failed")
                await asyncio.sleep(0.5)

    async def _listen(self) -> None:
        """LISTEN for releases; reconnects after outages. Polling covers any gap."""
        assert self.listen_url is not None

        def wake(*_args: Any) -> None:
            self._wake.set()

        while True:
            try:
                conn = await asyncpg.connect(self.listen_url, timeout=5)
                closed = asyncio.Event()
                conn.add_termination_listener(lambda _c, ev=closed: ev.set())
                try:
                    await conn.add_listener(claims.NOTIFY_CHANNEL, wake)
                    while not closed.is_set():
                        # a silent network loss is only seen on use: probe now and then
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(LISTEN_PROBE_INTERVAL_S):
                                await closed.wait()
                        await conn.execute("SELECT 1", timeout=5)
                finally:
                    await conn.close(timeout=1)
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(1)

    def stop(self) -> None:
        """Stop claiming; calls in flight finish and their outcomes are committed."""
        self._stopping.set()
        self._wake.set()
        self._slot_freed.set()


def listen_url_of(url: URL) -> str:
    """A plain postgresql:// URL for asyncpg's LISTEN connection."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


async def run_worker_process(settings: Settings, policies: Policies, url: URL) -> None:
    """`sweeper worker`: the pool alone, until SIGTERM or SIGINT."""
    import signal

    initialise_series(policies.policies)
    engine = make_engine(url, settings)
    upstreams = Upstreams(policies.upstreams)
    pool = WorkerPool(engine, policies, upstreams, concurrency=settings.workers,
                      listen_url=listen_url_of(url),
                      grace_seconds=settings.shutdown_grace_seconds)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pool.stop)
    log.info("worker started", extra={"worker": pool.name, "concurrency": settings.workers})
    try:
        await pool.run()
    finally:
        await upstreams.aclose()
        await engine.dispose()
        log.info("worker stopped", extra={"worker": pool.name, "completed": pool.completed})
