"""Faults injected into the pool's ports (issue 44): completions go first and alone, failed
scope signals of every kind are kept and retried, and every unexpected error is logged once
with its class and counted in sweeper_internal_errors_total{where}.

Each test fails on the pool before this change: a failing signal step kept every completion
back, a failed adjust dropped its refunds, the urgent apply and the warm-up swallowed their
errors, the last flush gave up without a word, and a call cancelled before its first step
left the in-flight gauge raised and its lease unreturned."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import pytest

from service.budget.answer_effects import ScopeEffects
from service.budget.rules import Closure
from service.history.tally import Tally
from service.observability.failures import InternalErrors
from service.observability.metrics import REGISTRY, Where
from service.outcomes import Answer
from service.worker.signals import SignalBuffer
from tests.unit.test_worker_rounds import Rig, VirtualClock, rig

SECRET = "acme-object-42"  # a request value: must never reach a log line


def counted(where: Where) -> float:
    return REGISTRY.get_sample_value("sweeper_internal_errors_total",
                                     {"where": where.value}) or 0.0


def logged(caplog: pytest.LogCaptureFixture, where: Where) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.getMessage() == "internal error" and getattr(r, "where", None) == where.value]


class Broken:
    """Raises `error` on the named port methods of a memory ledger, `times` times each."""

    def __init__(self, r: Rig, methods: Sequence[str], times: int = 1,
                 error: Exception | None = None) -> None:
        self.left = dict.fromkeys(methods, times)
        self.error = error or RuntimeError(f"a bug near {SECRET}")
        for name in methods:
            original = getattr(r.ledger, name)
            setattr(r.ledger, name, self._wrap(name, original))

    def _wrap(self, name: str, original: object) -> object:
        async def broken(*args: object) -> object:
            if self.left[name]:
                self.left[name] -= 1
                raise self.error
            return await original(*args)  # type: ignore[operator]
        return broken


async def test_a_failing_signal_step_holds_no_completion_back(
        caplog: pytest.LogCaptureFixture) -> None:
    r = rig(concurrency=4)
    [item, *_] = r.ledger.add("tenant:a", 4)
    r.calls.answers[item.object_id] = Answer(status=429)  # backs off: a closure waits
    Broken(r, ["close"], times=1_000)
    before = counted(Where.URGENT_SIGNALS) + counted(Where.SIGNALS)
    await r.pool.run_once()
    assert not await r.pool.drain()  # the closure is still waiting...
    assert len(r.ledger.completed) == 4  # ...and every outcome was written all the same
    assert counted(Where.URGENT_SIGNALS) + counted(Where.SIGNALS) > before
    assert SECRET not in caplog.text


async def test_a_failing_hand_back_holds_no_completion_back() -> None:
    r = rig(concurrency=8)
    items = r.ledger.add("tenant:a", 3)
    r.ledger.on_admit = r.pool.stop  # stop mid-admission: the leases go back uncalled
    Broken(r, ["hand_back"])
    before = counted(Where.HAND_BACK)
    assert await r.pool.run_once() == 0
    assert r.ledger.handed_back == [] and counted(Where.HAND_BACK) == before + 1
    assert await r.pool.flush(force=True)  # kept, and handed back on the next flush
    assert r.ledger.handed_back == items


class Port:
    """A scope-signal port whose adjust and recovery fail once."""

    def __init__(self) -> None:
        self.adjusted: list[tuple[dict[str, float], dict[str, float]]] = []
        self.recovered_scopes: list[str] = []
        self.closed: list[dict[str, Closure]] = []
        self.fail = {"adjust", "recovered"}

    async def close(self, closures: Mapping[str, Closure]) -> None:
        if closures:
            self.closed.append(dict(closures))

    async def pause(self, scopes: Sequence[str], reason: str) -> list[str]:
        return list(scopes)

    async def recovered(self, scopes: Sequence[str]) -> None:
        if scopes and "recovered" in self.fail:
            self.fail.discard("recovered")
            raise ConnectionRefusedError()
        self.recovered_scopes.extend(scopes)

    async def adjust(self, refunds: Mapping[str, float], caps: Mapping[str, float]) -> None:
        if (refunds or caps) and "adjust" in self.fail:
            self.fail.discard("adjust")
            raise ConnectionRefusedError()
        if refunds or caps:
            self.adjusted.append((dict(refunds), dict(caps)))


async def test_refunds_caps_and_recoveries_that_fail_are_kept_and_retried() -> None:
    port = Port()
    tally = Tally()
    signals = SignalBuffer(port, InternalErrors(logging.getLogger("tests")), tally,
                           VirtualClock())
    signals.note("carts", "tenant:a", ScopeEffects(backs_off=True))
    signals.note("carts", "tenant:a", ScopeEffects(succeeded=True))  # recovered
    signals.note("carts", "tenant:b", ScopeEffects(refund=2.0, cap=5.0))
    signals.note("carts", "tenant:b", ScopeEffects(refund=1.0, cap=3.0))
    signals.note("carts", "tenant:c", ScopeEffects(closure=Closure(1.0, 0.1, 1.0)))
    assert [counts["closures"] for counts in tally.scopes.values()] == [1]  # tenant:c's
    assert not await signals.flush()
    assert port.adjusted == [] and port.recovered_scopes == []
    assert await signals.flush()
    assert port.adjusted == [({"tenant:b": 3.0}, {"tenant:b": 3.0})]
    assert port.recovered_scopes == ["tenant:a"]
    assert await signals.flush()  # applied once: nothing is sent twice
    assert len(port.adjusted) == 1


async def test_the_urgent_apply_logs_and_counts_what_it_could_not_write(
        caplog: pytest.LogCaptureFixture) -> None:
    r = rig(concurrency=1)
    [item] = r.ledger.add("tenant:a", 1)
    r.calls.answers[item.object_id] = Answer(status=429, retry_after="5")
    Broken(r, ["close"])
    before = counted(Where.URGENT_SIGNALS)
    await r.pool.run_once()
    await r.pool.drain()
    assert counted(Where.URGENT_SIGNALS) == before + 1
    [line] = logged(caplog, Where.URGENT_SIGNALS)
    assert line.error_type == "RuntimeError" and SECRET not in caplog.text  # type: ignore[attr-defined]
    assert r.ledger.closures  # kept, and applied by the next flush


async def test_a_failed_warm_up_is_logged_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    r = rig(concurrency=1)
    Broken(r, ["database_time"])
    r.ledger.add("tenant:a", 2)
    before = counted(Where.WARM_UP)
    running = asyncio.create_task(r.pool.run())
    await r.until(lambda: len(r.ledger.completed) >= 2)
    r.pool.stop()
    await running
    assert counted(Where.WARM_UP) == before + 1
    [line] = logged(caplog, Where.WARM_UP)
    assert line.error_type == "RuntimeError"  # type: ignore[attr-defined]


async def test_the_last_flush_says_how_many_outcomes_it_could_not_write(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # the pool's own pause between its last flushes too (its module holds the name):
    # 50 tries of 0.5 s each made this test last 25 s
    monkeypatch.setattr("service.worker.pending_writes.FLUSH_RETRY_S", 0.0)
    monkeypatch.setattr("service.worker.pool.FLUSH_RETRY_S", 0.0)
    r = rig(concurrency=4)
    r.ledger.add("tenant:a", 3)
    r.ledger.fail_completes = 1_000_000
    before = counted(Where.SHUTDOWN_FLUSH)
    running = asyncio.create_task(r.pool.run())
    await r.until(lambda: len(r.calls.calls) >= 3)
    r.pool.stop()
    await running
    assert r.pool.unwritten == 3 and r.ledger.completed == []
    assert counted(Where.SHUTDOWN_FLUSH) == before + 1
    [line] = [x for x in caplog.records if x.getMessage() == "shutdown: writes could not be made"]
    assert line.outcomes == 3  # type: ignore[attr-defined]


async def test_a_call_cancelled_before_its_first_step_hands_its_lease_back() -> None:
    r = rig(concurrency=4)
    items = r.ledger.add("tenant:a", 2)
    gauge = REGISTRY.get_sample_value("sweeper_upstream_in_flight") or 0.0
    assert await r.pool.run_once() == 2
    cancelled = list(r.pool._in_flight)
    for task in cancelled:
        task.cancel()  # before the loop ran a single step of it
    # the pool's done-callbacks were added first, so they have run once these are awaited
    await asyncio.gather(*cancelled, return_exceptions=True)
    assert REGISTRY.get_sample_value("sweeper_upstream_in_flight") == gauge
    assert await r.pool.flush(force=True)
    assert sorted(r.ledger.handed_back, key=lambda lease: lease.item_id) == sorted(
        items, key=lambda lease: lease.item_id)
    assert r.calls.calls == []


async def test_a_tally_the_database_refused_is_written_with_the_next_one() -> None:
    r = rig(concurrency=4, fail_minutes=1)
    r.ledger.add("tenant:a", 4)
    await r.pool.run_once()
    assert await r.pool.drain()  # the outcomes are written; the tally is refused, kept
    assert not r.ledger.minutes
    r.ledger.add("tenant:a", 2)
    await r.pool.run_once()
    await r.pool.drain()
    [counts] = r.ledger.minutes.policies.values()
    assert counts["succeeded"] == 6  # both rounds' outcomes, each counted once
    [scope] = r.ledger.minutes.scopes.values()
    assert scope["calls"] == 6
