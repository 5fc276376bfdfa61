"""Drills where the upstream misbehaves: hangs, drips, resets, 5xx, garbage, and 429s in
every form. Each outcome must be classified once and acted on the way DESIGN.md says."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

from drills.base import Drill, Facts, check
from drills.stage import Stage
from drills.upstream import Call, Fault
from service.budget.rules import LOOKAHEAD_S, late_tolerance


async def _outcomes(stage: Stage, object_id: str) -> list[str]:
    return [outcome for outcome, _ in await stage.attempt_history(object_id)]


async def hang_drip_reset(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    stage.write_policies(lease=10, timeout=1.5, backoff_base=0.2, backoff_max=0.5)
    faulty = ["hang", "drip", "reset"]
    others = [f"o{i}" for i in range(10)]
    keys = dict(zip(faulty + others, await stage.register(faulty + others), strict=True))
    upstream.inject(Fault.HANG, seconds=30, match="/hang")
    upstream.inject(Fault.DRIP, seconds=30, interval=0.2, match="/drip")
    upstream.inject(Fault.RESET, match="/reset")
    workers = [stage.start_worker(workers=2) for _ in range(2)]
    await stage.release()
    await stage.wait_all_finished(len(keys), 60)
    check(await stage.statuses() == {"succeeded": len(keys)}, f"{await stage.statuses()}")
    for name in faulty:
        calls = upstream.calls_for_key(keys[name])
        check(len(calls) == 2, f"{name}: {len(calls)} calls, expected the fault and one retry")
        check(await _outcomes(stage, name) == ["unknown", "succeeded"],
              f"{name}: attempts {await _outcomes(stage, name)}")
        check(upstream.max_in_flight(keys[name]) == 1,
              f"{name}: two calls of the item were in flight at once")
    for name in others:
        check(len(upstream.calls_for_key(keys[name])) == 1, f"{name} was called twice")
    await stage.stop_all(workers)
    return {"unknown_then_retried": len(faulty), "max_in_flight_per_key": 1,
            "calls": len(upstream.calls())}


BACKOFF_BASE_S = 1.0


async def server_errors(stage: Stage) -> Facts:
    max_attempts, n = 4, 8
    upstream = stage.start_upstream()
    stage.write_policies(max_attempts=max_attempts, backoff_base=BACKOFF_BASE_S,
                         backoff_max=60, timeout=2)
    keys = await stage.register([f"o{i}" for i in range(n)])
    upstream.inject(Fault.STATUS, status=503, times=None)
    # the retry delay each completion chose, read from the ledger: next_attempt_at is set
    # from the database clock in the same statement as updated_at
    planned: dict[tuple[str, int], float] = {}

    async def sample() -> None:
        while True:
            for r in await stage.fetch(
                    "SELECT object_id, attempts, extract(epoch FROM next_attempt_at "
                    "- updated_at)::float AS delay FROM items WHERE status = 'pending' "
                    "AND lease_token IS NULL AND attempts > 0"):
                planned.setdefault((r["object_id"], int(r["attempts"])), float(r["delay"]))
            await asyncio.sleep(0.02)

    workers = [stage.start_worker(workers=2) for _ in range(2)]
    sampler = asyncio.create_task(sample())
    try:
        await stage.release()
        await stage.wait_all_finished(n, 60)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    rows = await stage.fetch("SELECT status, attempts, dead_reason FROM items")
    check({(r["status"], r["attempts"], r["dead_reason"]) for r in rows}
          == {("dead", max_attempts, "max_attempts:http_503")}, f"items {rows}")
    gaps: dict[int, list[float]] = {}
    for key in keys:
        calls = upstream.calls_for_key(key)
        check(len(calls) == max_attempts, f"{len(calls)} calls of one item")
        for k in range(1, max_attempts):
            gaps.setdefault(k, []).append(calls[k].received_at - calls[k - 1].received_at)
    check(len(planned) >= n * (max_attempts - 1) // 2,
          f"only {len(planned)} retry delays observed")
    for (_, attempt), delay in planned.items():
        ceiling = BACKOFF_BASE_S * 2 ** (attempt - 1)
        check(0 <= delay <= ceiling + 0.001,
              f"attempt {attempt} planned {delay:.3f} s, outside [0, {ceiling}] s")
    ratios = [d / (BACKOFF_BASE_S * 2 ** (a - 1)) for (_, a), d in planned.items()]
    # full jitter: delays spread over [0, ceiling], not all at the ceiling
    check(max(ratios) - min(ratios) > 0.3, f"no jitter: delay/ceiling {sorted(ratios)}")
    for (obj, attempt), delay in planned.items():
        gap = gaps[attempt][int(obj[1:])]
        check(gap >= delay - 0.05,
              f"{obj} retried {gap:.2f} s after attempt {attempt}, before its delay {delay:.2f}")
    await stage.stop_all(workers)
    return {"calls": len(upstream.calls()), "dead": n,
            "mean_gap_s": [round(statistics.mean(gaps[k]), 2) for k in sorted(gaps)],
            "delays_observed": len(planned)}


BODY_MIB = 24


async def garbage_bodies(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    stage.write_policies(max_attempts=2, backoff_base=0.1, timeout=5)
    marker = f"SECRET-{stage.label}".encode()
    big = (marker + b"\xff\x00" * (BODY_MIB << 19))[: BODY_MIB << 20]
    objects = ["big-200", "garbage-200", "garbage-500", "big-422", "big-429"]
    keys = dict(zip(objects, await stage.register(objects), strict=True))
    upstream.inject(Fault.STATUS, status=200, body=big, match="/big-200")
    upstream.inject(Fault.GARBAGE, status=200, size=BODY_MIB << 20, match="/garbage-200")
    upstream.inject(Fault.GARBAGE, status=500, size=1 << 20, times=None, match="/garbage-500")
    upstream.inject(Fault.STATUS, status=422, body=big, match="/big-422")
    upstream.inject(Fault.STATUS, status=429, body=big, headers={"Retry-After": "1"},
                    match="/big-429")
    worker = stage.start_worker(workers=4)
    await stage.wait_started(worker)
    await asyncio.sleep(1.0)  # let start-up allocations settle before the baseline
    before = await worker.peak_rss_kib()
    await stage.release()
    await stage.wait_all_finished(len(objects), 40)
    after = await worker.peak_rss_kib()
    expected = {"big-200": ("succeeded", None), "garbage-200": ("succeeded", None),
                "garbage-500": ("dead", "max_attempts:http_500"),
                "big-422": ("dead", "http_422"), "big-429": ("succeeded", None)}
    for name, (status, reason) in expected.items():
        rows = await stage.fetch("SELECT status, dead_reason FROM items WHERE object_id = $1",
                                 name)
        check((rows[0]["status"], rows[0]["dead_reason"]) == (status, reason),
              f"{name}: {dict(rows[0])}, expected {status} {reason}")
    check(await _outcomes(stage, "big-429") == ["throttled", "succeeded"],
          f"big-429 attempts {await _outcomes(stage, 'big-429')}")
    growth_mib = (after - before) / 1024
    check(growth_mib < BODY_MIB / 2,
          f"the worker's peak memory grew {growth_mib:.1f} MiB reading {BODY_MIB} MiB bodies")
    await stage.stop_all([worker])
    log = worker.log()
    check(marker.decode() not in log, "a response body reached the worker's log")
    longest = max((len(line) for line in log.splitlines()), default=0)
    check(longest < 2000, f"a log line of {longest} characters")
    check('"body": "attempt"' in log, "the worker logged no attempts at all (log level?)")
    return {"bodies_mib": BODY_MIB, "peak_rss_growth_mib": round(growth_mib, 1),
            "log_bytes": len(log), "calls": len(upstream.calls()),
            "keys": len(keys)}


RETRY_AFTER_MAX_S = 4.0


def _in_scope(tenant: str) -> Callable[[Call], bool]:
    return lambda call: call.scope == tenant


# The delay each Retry-After form asks for, in seconds after the 429 (the date's is computed
# from the date sent), as the policy's retry_after_max_seconds clamps it; a past date and a
# malformed value are no usable date: the scope backs off by policy.
_FORM_DELAYS_S = {"seconds": 3.0, "past": 0.0, "far": RETRY_AFTER_MAX_S, "malformed": 1.0}


async def retry_after_forms(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    rate = 10
    stage.write_policies(rate=rate, burst=1, backoff_base=1.0, backoff_max=10,
                         retry_after_max=RETRY_AFTER_MAX_S)
    date = datetime.now(UTC) + timedelta(seconds=5)
    forms = {"seconds": "3", "date": format_datetime(date, usegmt=True),
             "past": "Wed, 21 Oct 2015 07:28:00 GMT", "far": "999999999999",
             "malformed": "soon, maybe"}
    for form, value in forms.items():
        tenant = stage.tenant(form)
        await stage.register([f"o{i}" for i in range(20)], tenant)
        upstream.inject(Fault.STATUS, status=429, headers={"Retry-After": value},
                        match=_in_scope(tenant))
    await stage.register([f"o{i}" for i in range(40)], stage.tenant("steady"))
    workers = [stage.start_worker(workers=3) for _ in range(3)]
    await stage.wait_started(*workers)
    await stage.release()
    await stage.wait_all_finished(5 * 20 + 40, 60)
    check(await stage.statuses() == {"succeeded": 140}, f"items {await stage.statuses()}")
    calls = upstream.calls()

    def of(form: str) -> list[Call]:
        return sorted((c for c in calls if c.scope == stage.tenant(form)),
                      key=lambda c: c.received_at)

    facts: Facts = {}
    dispatched = 0
    for form in forms:
        gap, early = await _closure_obeyed(stage, form, of(form), date, rate)
        facts[f"{form}_gap_s"] = round(gap, 2)
        dispatched += early
    facts["dispatched_before_closure"] = dispatched
    facts["steady_pace_per_s"] = round(_steady_pace([c.received_at for c in of("steady")],
                                                    rate), 1)
    await stage.stop_all(workers)
    return facts


async def _closure_obeyed(stage: Stage, form: str, scope_calls: list[Call], date: datetime,
                          rate: float) -> tuple[float, int]:
    """Check that the scope throttled with one `form` of Retry-After was closed from the
    earliest moment the form allows (relative to the 429, monotonic) until at most a little
    after it (the delay plus its jitter and a poll interval); its gap to the next call, and
    the calls that were already under way when the closure committed."""
    throttled = [c for c in scope_calls if c.outcome == "status"]
    check(len(throttled) == 1, f"{form}: {len(throttled)} 429s")
    t429 = throttled[0]
    closed_at = float(await stage.fetchval(
        "SELECT extract(epoch FROM updated_at) FROM scopes WHERE name = $1",
        f"tenant:{stage.tenant(form)}"))
    # the date is whole seconds on the wire; clamped like any value to retry_after_max_seconds
    earliest = (min(date.replace(microsecond=0).timestamp() - t429.wall_time, RETRY_AFTER_MAX_S)
                if form == "date" else _FORM_DELAYS_S[form])
    # Calls whose tokens and leases were taken before the closure committed may still
    # land: a token is due at most the lookahead after its grant, and may be spent up
    # to late_tolerance(rate) after it is due. None may start later than that.
    after = [c for c in scope_calls if c.received_at > t429.received_at]
    early = [c for c in after if c.received_at - t429.received_at < earliest - 0.02]
    spent_by = LOOKAHEAD_S + late_tolerance(rate) + 0.05
    late_starts = [round(c.wall_time - closed_at, 3) for c in early
                   if c.wall_time > closed_at + spent_by]
    check(not late_starts,
          f"{form}: calls {late_starts} s after the closure committed, before the "
          f"{earliest:.2f} s allowed")
    rest = [c for c in after if c not in early]
    check(bool(rest), f"{form}: no call after the closure")
    gap = rest[0].received_at - t429.received_at
    check(gap <= earliest + 1.0 + 2.5,
          f"{form}: the scope stayed closed {gap:.2f} s (allowed from {earliest:.2f} s)")
    return gap, len(early)


def _steady_pace(received: list[float], rate: float) -> float:
    """Check that the scope no 429 touched kept its budget's pace; the pace (calls/s)."""
    span = max(received) - min(received)
    pace = (len(received) - 1) / span if span > 0 else 0.0
    check(pace >= 0.8 * rate, f"the untouched scope ran at {pace:.1f}/s, not {rate}/s")
    return pace


STORM_429S = 12


async def throttle_storm(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    base = 0.1
    stage.write_policies(rate=20, burst=1, backoff_base=base, backoff_max=5, max_attempts=2)
    stormy, steady = stage.tenant("storm"), stage.tenant("steady")
    await stage.register([f"o{i}" for i in range(20)], stormy)
    await stage.register([f"o{i}" for i in range(20)], steady)
    # calls already sent when a closure lands count once (buckets.close): twelve 429s make
    # six closures even when they arrive in pairs, so one pair comes after the fifth (1.6 s)
    # and the largest gap clears 8 x base by more than a pair's spacing
    upstream.inject(Fault.STATUS, status=429, times=STORM_429S,
                    match=lambda c: c.scope == stormy)
    workers = [stage.start_worker(workers=2) for _ in range(2)]
    await stage.wait_started(*workers)
    await stage.release()
    await stage.wait_all_finished(40, 60)
    check(await stage.statuses() == {"succeeded": 40},
          f"items {await stage.statuses()}: something went dead for throttling")
    attempts = await stage.fetch("SELECT DISTINCT attempts FROM items")
    check([r["attempts"] for r in attempts] == [1],
          f"throttled attempts were held against items: {[dict(r) for r in attempts]}")
    calls = upstream.calls()
    storm = [c.received_at for c in calls if c.scope == stormy and c.outcome == "status"]
    check(len(storm) == STORM_429S, f"{len(storm)} 429s")
    gaps = [b - a for a, b in itertools.pairwise(storm)]
    check(max(gaps) >= 8 * base,
          f"the scope's backoff never grew past {max(gaps):.2f} s (base {base} s)")
    levels = await stage.fetch("SELECT name, backoff_level FROM scopes")
    check(all(r["backoff_level"] == 0 for r in levels),
          f"backoff not reset by the successes: {[dict(r) for r in levels]}")
    quiet = [c.received_at for c in calls if c.scope == steady]
    check(all(c.outcome == "ok" for c in calls if c.scope == steady),
          "the steady scope was throttled")
    pace = (len(quiet) - 1) / (max(quiet) - min(quiet))
    check(pace >= 0.8 * 20, f"the steady scope ran at {pace:.1f}/s, not 20/s")
    await stage.stop_all(workers)
    return {"throttled": len(storm), "dead": 0, "max_429_gap_s": round(max(gaps), 2),
            "steady_pace_per_s": round(pace, 1)}


DRILLS = [
    Drill(7, "upstream-hang-drip-reset",
          "13 items, 2 worker processes, upstream deadline 1.5 s",
          "the upstream hangs on one item, drips one byte per 0.2 s on another, resets the "
          "connection after reading the request on a third",
          "each is `unknown`, retried once with the same key and then succeeds; never two "
          "calls of one item in flight at once; the others are called once",
          hang_drip_reset),
    Drill(8, "5xx-every-call",
          "8 items, max_attempts 4, backoff base 1 s, 2 worker processes",
          "the upstream answers 503 to every call",
          "each planned retry delay is within [0, base * 2^(n-1)] and they vary (full "
          "jitter); no call comes before its delay; dead at max_attempts after 4 calls",
          server_errors),
    Drill(9, "garbage-bodies",
          f"5 items, one worker process; bodies of {BODY_MIB} MiB carrying a marker",
          "huge and binary bodies on 200, 422, 429 and 500 answers",
          "classified by status alone, the worker's peak memory stays far below the body "
          "size, and no body byte reaches the log", garbage_bodies),
    Drill(10, "retry-after-forms",
          "6 scopes at 10/s, 3 worker processes, retry_after_max_seconds 4",
          "the first call of five scopes gets 429 with Retry-After 3, an HTTP-date, a past "
          "date, a far-future value and a malformed value",
          "no call to that scope from any process before the time allowed (clamped, or the "
          "backoff when unreadable); the sixth scope keeps its pace", retry_after_forms),
    Drill(11, "429-storm",
          "two scopes at 20/s, max_attempts 2, backoff base 0.1 s, 2 worker processes",
          "twelve 429s without Retry-After on one scope",
          "that scope backs off (growing gaps, 429s of calls already sent counting once), "
          "nothing goes dead, no attempt is counted, the other scope keeps its pace",
          throttle_storm),
]
