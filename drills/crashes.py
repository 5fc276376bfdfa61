"""Drills where a worker process dies, stalls or runs on a wrong clock: leases, reclaims and
fenced completions decide what happens next."""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence

import httpx

from drills.base import Drill, Facts, check
from drills.stage import PROCESS_START_TIMEOUT_S, Proc, Stage
from drills.upstream import Fault
from service.db.statements import item_status

LEASE_S = 5  # the shortest lease a policy allows: every reclaim below waits this long
TIMEOUT_S = 3.0  # upstream deadline, shorter than the lease as the policies file requires


_ITEM_SQL = (f"SELECT id, {item_status('items')} AS status, attempts, lease_owner, "  # noqa: S608
             "lease_expires_at, dead_reason FROM items WHERE object_id = $1")


async def _item(stage: Stage, object_id: str) -> dict[str, object]:
    rows = await stage.fetch(_ITEM_SQL, object_id)
    check(len(rows) == 1, f"item {object_id} not found")
    return dict(rows[0])


async def _attempts(stage: Stage, object_id: str) -> list[tuple[str, bool]]:
    return await stage.attempt_history(object_id)


async def _succeeded(stage: Stage, object_id: str) -> bool:
    return (await _item(stage, object_id))["status"] == "succeeded"


async def kill_after_claim(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    stage.write_policies(lease=LEASE_S, timeout=TIMEOUT_S)
    [key] = await stage.register(["victim"])
    await stage.release()
    first = stage.start_worker(workers=1,
                               agent={"SWEEPER_DRILL_CRASH_AFTER_CLAIM": "victim"})
    code = await first.wait(PROCESS_START_TIMEOUT_S)
    killed_at = time.monotonic()
    check(code == -signal.SIGKILL, f"the worker exited with {code}, expected SIGKILL")
    held = await _item(stage, "victim")
    check(held["status"] == "leased" and held["attempts"] == 1,
          f"after the kill the item is {held}")
    check(upstream.calls() == [], "the killed worker called the upstream")

    second = stage.start_worker(workers=1)
    await stage.wait_for("reclaimed and succeeded", lambda: _succeeded(stage, "victim"),
                         LEASE_S + PROCESS_START_TIMEOUT_S)
    recovery = time.monotonic() - killed_at
    calls = upstream.calls_for_key(key)
    check(len(calls) == 1, f"{len(calls)} upstream calls, expected 1")
    expires = held["lease_expires_at"]
    assert hasattr(expires, "timestamp")
    check(calls[0].wall_time >= expires.timestamp() - 0.05,
          "the item was called again before its lease expired")
    done = await _item(stage, "victim")
    check(done["attempts"] == 2, f"attempts {done['attempts']}, expected 2 (one per claim)")
    check(await _attempts(stage, "victim") == [("succeeded", False)],
          f"attempt rows {await _attempts(stage, 'victim')}")
    check(await stage.stop(second) == 0, "the second worker did not stop cleanly")
    return {"calls": 1, "recovery_s": recovery, "lease_s": LEASE_S}


async def kill_after_2xx(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    stage.write_policies(lease=LEASE_S, timeout=TIMEOUT_S)
    [key] = await stage.register(["victim"])
    await stage.release()
    first = stage.start_worker(workers=1,
                               agent={"SWEEPER_DRILL_CRASH_BEFORE_COMMIT": "victim"})
    code = await first.wait(PROCESS_START_TIMEOUT_S)
    killed_at = time.monotonic()
    check(code == -signal.SIGKILL, f"the worker exited with {code}, expected SIGKILL")
    check(len(upstream.calls()) == 1, f"{len(upstream.calls())} calls before the kill")
    held = await _item(stage, "victim")
    check(held["status"] == "leased", f"the 2xx was committed after all: {held}")

    second = stage.start_worker(workers=1)
    await stage.wait_for("reclaimed and succeeded", lambda: _succeeded(stage, "victim"),
                         LEASE_S + PROCESS_START_TIMEOUT_S)
    recovery = time.monotonic() - killed_at
    calls = upstream.calls_for_key(key)
    check(len(calls) == 2 and len(upstream.calls()) == 2,
          f"{len(upstream.calls())} calls, expected exactly 2")
    check(calls[0].idempotency_key == calls[1].idempotency_key == key,
          "the repeat did not carry the same Idempotency-Key")
    done = await _item(stage, "victim")
    check(done["attempts"] == 2, f"attempts {done['attempts']}")
    check(await _attempts(stage, "victim") == [("succeeded", False)],
          f"attempt rows {await _attempts(stage, 'victim')}")
    check(await stage.stop(second) == 0, "the second worker did not stop cleanly")
    return {"calls": 2, "duplicates_in_window": 1, "recovery_s": recovery}


async def _late_completions(proc: Proc) -> float:
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{proc.base_url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("sweeper_late_completions_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _stall_first_attempt(stage: Stage, *, second_delay: float) -> tuple[Proc, str]:
    """Worker A calls `victim` and is frozen (SIGSTOP) while the answer is on its way."""
    upstream = stage.start_upstream()
    stage.write_policies(lease=LEASE_S, timeout=TIMEOUT_S)
    [key] = await stage.register(["victim"])
    upstream.inject(Fault.STATUS, status=204, delay=1.0, match="victim")
    if second_delay:
        upstream.inject(Fault.STATUS, status=204, delay=second_delay, match="victim")
    stalled = stage.start_worker(workers=1, metrics=True)
    await stage.wait_started(stalled)
    await stage.release()

    async def called() -> bool:
        return len(upstream.calls_for_key(key)) >= 1

    await stage.wait_for("first call", called, 30, 0.01)
    stalled.signal(signal.SIGSTOP)
    return stalled, key


async def _fenced_rows(stage: Stage) -> int:
    return int(await stage.fetchval("SELECT count(*) FROM attempts WHERE fenced"))


async def stalled_worker_fenced(stage: Stage) -> Facts:
    stalled, key = await _stall_first_attempt(stage, second_delay=0)
    other = stage.start_worker(workers=1)
    await stage.wait_for("re-claimed and completed elsewhere",
                         lambda: _succeeded(stage, "victim"), LEASE_S + 60)
    stalled.signal(signal.SIGCONT)

    async def fenced() -> bool:
        return await _fenced_rows(stage) >= 1

    await stage.wait_for("the stalled worker's late completion", fenced, 20)
    assert stage.upstream is not None
    check(await _succeeded(stage, "victim"), "the late completion changed the item")
    rows = await _attempts(stage, "victim")
    check(sorted(f for _, f in rows) == [False, True] and rows[0] == ("succeeded", False),
          f"attempt rows {rows}: expected the second worker's success, then a fenced one")
    check(len(stage.upstream.calls_for_key(key)) == 2, "expected exactly two calls")
    check("late completion fenced out" in stalled.log(), "the stalled worker did not log it")
    late = await _late_completions(stalled)
    check(late == 1.0, f"sweeper_late_completions_total is {late} in the stalled worker")
    for proc in (stalled, other):
        check(await stage.stop(proc) == 0, f"{proc.name} did not stop cleanly")
    return {"calls": 2, "fenced": 1, "late_completions_metric": late,
            "final_outcome": rows[0][0]}


async def fenced_while_second_in_flight(stage: Stage) -> Facts:
    stalled, key = await _stall_first_attempt(stage, second_delay=2.0)
    assert stage.upstream is not None
    upstream = stage.upstream
    other = stage.start_worker(workers=1)

    async def second_call() -> bool:
        return len(upstream.calls_for_key(key)) >= 2

    await stage.wait_for("the second attempt's call", second_call, LEASE_S + 60, 0.02)
    stalled.signal(signal.SIGCONT)

    async def fenced() -> bool:
        return await _fenced_rows(stage) >= 1

    await stage.wait_for("the stalled worker's late completion", fenced, 20, 0.02)
    during = await _item(stage, "victim")
    # the overlap: the late write landed while the second attempt still held the lease
    check(during["status"] == "leased" and during["lease_owner"] is not None,
          f"the second attempt was not in flight at the late write: {during}")
    await stage.wait_for("the second attempt's success", lambda: _succeeded(stage, "victim"),
                         20)
    rows = await _attempts(stage, "victim")
    check(rows[0][1] and rows[1] == ("succeeded", False) and len(rows) == 2,
          f"attempt rows {rows}: expected the fenced late one, then the success")
    check(upstream.max_in_flight(key) == 1, "two calls of one item were in flight at once")
    check(len(upstream.calls_for_key(key)) == 2, "expected exactly two calls")
    late = await _late_completions(stalled)
    check(late == 1.0, f"sweeper_late_completions_total is {late} in the stalled worker")
    for proc in (stalled, other):
        check(await stage.stop(proc) == 0, f"{proc.name} did not stop cleanly")
    return {"calls": 2, "fenced_overlap": 1, "max_in_flight_per_key": 1}


async def poison_items(stage: Stage) -> Facts:
    max_attempts = 2
    upstream = stage.start_upstream()
    stage.write_policies(lease=LEASE_S, timeout=TIMEOUT_S, max_attempts=max_attempts)
    # Every worker crashes on the crasher's answer (it is the item, not the process), and
    # the orchestrator restarts it like a pod.
    agent = {"SWEEPER_DRILL_CRASH_ON_ANSWER": "crasher"}
    slots = [stage.start_worker(workers=2, agent=agent) for _ in range(2)]
    workers = list(slots)
    crashes = 0

    def restart_crashed() -> None:
        nonlocal crashes
        for i, proc in enumerate(slots):
            if not proc.alive():
                crashes += 1
                slots[i] = stage.start_worker(workers=2, agent=agent)
                workers.append(slots[i])

    # 1. a 422 among healthy items: dead at once, the rest succeed
    others = [f"o{i}" for i in range(10)]
    keys = dict(zip(["rejected", *others], await stage.register(["rejected", *others]),
                    strict=True))
    upstream.inject(Fault.STATUS, status=422, times=None, match="/rejected")
    await stage.release()
    await stage.wait_all_finished(len(keys), 30)
    rejected = await _item(stage, "rejected")
    check(rejected["status"] == "dead" and rejected["attempts"] == 1
          and rejected["dead_reason"] == "http_422", f"the 422 item is {rejected}")
    check(len(upstream.calls_for_key(keys["rejected"])) == 1, "the 422 item was retried")
    check(await stage.statuses() == {"dead": 1, "succeeded": len(others)},
          f"items {await stage.statuses()}")
    # 2. the crasher alone: a crash also loses the outcomes its process had not committed
    # yet (the documented window), so healthy items beside it would retry by chance
    [keys["crasher"]] = await stage.register(["crasher"])
    await stage.release()

    async def crasher_settled() -> bool:
        calls = len(upstream.calls_for_key(keys["crasher"]))
        check(calls <= max_attempts,
              f"the crashing item was called {calls} times with max_attempts {max_attempts}")
        restart_crashed()
        return (await _item(stage, "crasher"))["status"] == "dead"

    await stage.wait_for("the crashing item dead", crasher_settled,
                         max_attempts * (LEASE_S + PROCESS_START_TIMEOUT_S))
    crasher = await _item(stage, "crasher")
    check(crasher["dead_reason"] == "max_attempts:lease_expired",
          f"crasher dead for {crasher['dead_reason']}")
    called = [round(c.wall_time, 3) for c in upstream.calls_for_key(keys["crasher"])]
    check(len(called) == max_attempts, f"the crashing item was called at {called}, not "
                                       f"max_attempts ({max_attempts}) times")
    check(crashes == max_attempts, f"{crashes} worker crashes for {max_attempts} attempts")
    check(await stage.statuses() == {"dead": 2, "succeeded": len(others)},
          f"items {await stage.statuses()}")
    for proc in workers:
        if proc.alive():
            check(await stage.stop(proc) == 0, f"{proc.name} did not stop cleanly")
    return {"crashes": crashes, "crasher_calls": max_attempts, "rejected_calls": 1,
            "crasher_reason": crasher["dead_reason"]}


async def clock_jump(stage: Stage) -> Facts:
    upstream = stage.start_upstream()
    stage.write_policies(lease=LEASE_S, timeout=TIMEOUT_S)
    reclaim_delays: dict[str, float] = {}

    async def hold_and_stall(object_id: str, holder: Proc) -> tuple[str, float]:
        [key] = await stage.register([object_id])
        upstream.inject(Fault.HANG, seconds=60, match=f"/{object_id}")
        await stage.release()
        await stage.wait_for(f"{object_id} called",
                             lambda: _called(upstream.calls_for_key(key)), 30, 0.02)
        holder.signal(signal.SIGSTOP)
        expires = (await _item(stage, object_id))["lease_expires_at"]
        assert hasattr(expires, "timestamp")
        return key, float(expires.timestamp())

    async def reclaimed_on_time(object_id: str, key: str, expires: float, shift: float
                                ) -> None:
        await stage.wait_for(f"{object_id} reclaimed", lambda: _succeeded(stage, object_id),
                             LEASE_S + 30)
        calls = upstream.calls_for_key(key)
        check(len(calls) == 2, f"{object_id}: {len(calls)} calls")
        # the fault is in place: the reclaiming worker stamped its attempt on its own clock
        # its success: the item records when the call started (no attempt row)
        started = await stage.fetchval(
            "SELECT extract(epoch FROM last_started_at)::float FROM items "
            "WHERE object_id = $1 AND status = 'succeeded'", object_id)
        skew = float(started) - calls[1].wall_time
        check(abs(skew - shift) < 5, f"{object_id}: the reclaiming worker's clock is off by "
                                     f"{skew:.0f} s, not {shift:.0f} s")
        lease_len = expires - calls[0].wall_time
        check(LEASE_S - 1 <= lease_len <= LEASE_S + 1,
              f"{object_id}: the lease ran {lease_len:.1f} s from the call, not {LEASE_S} s "
              "of database time")
        delay = calls[1].wall_time - expires
        reclaim_delays[object_id] = delay
        check(delay >= -0.05, f"{object_id} reclaimed {-delay:.2f} s before its lease expired")
        check(delay <= 3.0, f"{object_id} reclaimed {delay:.2f} s after its lease expired")

    first = stage.start_worker(workers=1)
    await stage.wait_started(first)
    key, expires = await hold_and_stall("held-1", first)
    # a worker an hour ahead sees every lease as long expired on its own clock
    ahead = stage.start_worker(workers=1, agent={"SWEEPER_DRILL_CLOCK_SHIFT_SECONDS": "3600"})
    await reclaimed_on_time("held-1", key, expires, 3600)
    # now it holds a lease itself and stalls; a worker an hour behind must not wait an hour
    key, expires = await hold_and_stall("held-2", ahead)
    behind = stage.start_worker(workers=1,
                                agent={"SWEEPER_DRILL_CLOCK_SHIFT_SECONDS": "-3600"})
    await reclaimed_on_time("held-2", key, expires, -3600)
    check(await stage.stop(behind) == 0, "the worker behind did not stop cleanly")
    return {"reclaim_after_expiry_ahead_s": reclaim_delays["held-1"],
            "reclaim_after_expiry_behind_s": reclaim_delays["held-2"]}


async def _called(calls: Sequence[object]) -> bool:
    return len(calls) >= 1


DRILLS = [
    Drill(1, "kill-after-claim",
          "one item, lease 5 s; a worker process that dies right after its claim commits",
          "SIGKILL the worker between the claim's commit and the upstream call",
          "another worker reclaims it after the lease (not before), one upstream call, "
          "succeeded", kill_after_claim),
    Drill(2, "kill-after-2xx",
          "one item, lease 5 s; the upstream answers 204",
          "SIGKILL the worker after the 2xx, before it commits the outcome",
          "exactly 2 calls with one Idempotency-Key, succeeded, one attempt row",
          kill_after_2xx),
    Drill(3, "stalled-worker-fenced",
          "one item; worker A calls it and is frozen (SIGSTOP) past its 5 s lease",
          "worker B re-claims and completes it; then A wakes and writes its outcome",
          "A's write changes nothing (fenced attempt row, log line, "
          "sweeper_late_completions_total = 1)", stalled_worker_fenced),
    Drill(4, "fenced-during-second-attempt",
          "as drill 3, but the upstream holds B's call for 2 s",
          "A wakes while B's attempt is still in flight",
          "A is fenced while B holds the lease, B's success stands, never two calls of the "
          "item in flight at once", fenced_while_second_in_flight),
    Drill(14, "poison-items",
          "11 items, then one more; max_attempts 2; 2 worker processes, restarted when "
          "they die (like pods)",
          "one item answers 422; another crashes its worker (SIGKILL) on every answer",
          "the 422 is dead after one call; the crasher is dead after max_attempts calls "
          "instead of looping; the rest succeed", poison_items),
    Drill(19, "clock-jump",
          "a worker holds a lease and freezes; workers whose wall clock is +1 h or -1 h",
          "the reclaiming worker's wall clock is an hour off",
          "reclaimed at the lease's database expiry, never before, not an hour late",
          clock_jump),
]
