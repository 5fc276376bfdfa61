"""The cluster's leader: one process runs the loops that must run once.

Every `sweeper serve` replica runs an `Elector`. One holds the `leader` row's lease (on the
database clock) and runs the cluster's duties (publication, holds maintenance, retention:
service/app.py); the others try to take the lease every RENEW_EVERY_S and take it only once
it has lapsed. The shape is River's leader elector (riverqueue/river
internal/leadership/elector.go): a row with an expiry, elected and renewed by one statement
each, given up at shutdown so a successor need not wait for the lease to run out.

Stopping before a successor starts:

- Each election raises the row's `term`. A duty statement whose double run would do harm
  carries the term it was started under and writes nothing once that term's lease has
  lapsed (publication's chunk commit: `fenced_by` in service/runs/publication.py).
- A leader stops its duties when its own estimate of the lease runs out: the lease ends
  LEASE_S after the database received the renewal, which is after this process sent it,
  so `sent + LEASE_S - STEP_DOWN_MARGIN_S` on this process's monotonic clock comes first,
  whatever the wall clocks say. A renewal that fails or hangs (a partition) cannot keep a
  leader past that point: the step is abandoned there and the duties are cancelled.

So a leader that dies is replaced within LEASE_S + RENEW_EVERY_S, one that shuts down
within RENEW_EVERY_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch, fetch_none
from service.observability.failures import InternalErrors, expected
from service.observability.metrics import LEADER, LEADER_TERM, Where

log = logging.getLogger("service.cluster.leader")

CLUSTER: Final = "cluster"  # the leader row of the cluster's duties
LEASE_S: Final = 5.0  # a lease's length on the database clock
RENEW_EVERY_S: Final = 1.0  # between a leader's renewals, and a follower's attempts
STEP_DOWN_MARGIN_S: Final = 1.0  # a leader stops this long before its lease ends

# A duty: started with the term it runs under, cancelled when the term ends.
Duty = Callable[[int], Coroutine[Any, Any, None]]

_ELECT = Statement("leader.elect", (
    "Take the leader row if nobody holds it or its lease has lapsed, in a new term."), """
    INSERT INTO leader AS l (name, holder, term, elected_at, expires_at)
    VALUES (:name, :holder, 1, now(), now() + make_interval(secs => :lease_s))
    ON CONFLICT (name) DO UPDATE
    SET holder = excluded.holder,
        term = l.term + 1,             -- a new term fences the old one's statements
        elected_at = now(),
        expires_at = excluded.expires_at
    WHERE l.expires_at <= now()        -- only a lapsed lease changes hands
    RETURNING term
""")
_RENEW = Statement("leader.renew", (
    "Extend the lease of the term this process holds, if it has not lapsed."), """
    UPDATE leader SET expires_at = now() + make_interval(secs => :lease_s)
    WHERE name = :name AND term = :term
      AND expires_at > now()           -- a lapsed lease may already be another's
    RETURNING term
""")
_RESIGN = Statement("leader.resign", (
    "End the lease of the term this process holds now, so a follower takes over at once."),
    "UPDATE leader SET expires_at = now() WHERE name = :name AND term = :term")
_CURRENT = Statement("leader.current", (
    "The leader whose lease is in force, if any: who, which term, until when."),
    "SELECT holder, term, expires_at FROM leader WHERE name = :name AND expires_at > now()")


@dataclass(frozen=True)
class Leadership:
    """The leader in force, as the database has it."""

    holder: str
    term: int
    lease_expires_at: datetime


async def current(engine: AsyncEngine, name: str = CLUSTER) -> Leadership | None:
    """The leader whose lease is in force now (None: the lease lapsed, or nobody led)."""
    rows = await fetch(engine, _CURRENT, {"name": name})
    return Leadership(rows[0].holder, rows[0].term, rows[0].expires_at) if rows else None


class Elector:
    """Holds or seeks the lease of `name` for `holder`; `run()` runs `duties` while it
    leads. `step()` is one election or renewal (tests drive it); `leading()` says whether
    this process may still act as the leader, by its own clock."""

    def __init__(self, engine: AsyncEngine, holder: str, *, name: str = CLUSTER,
                 lease_s: float = LEASE_S, renew_every_s: float = RENEW_EVERY_S,
                 margin_s: float = STEP_DOWN_MARGIN_S,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not 0 < margin_s < lease_s or not 0 < renew_every_s < lease_s - margin_s:
            raise ValueError("need 0 < margin < lease and 0 < renewal interval < "
                             "lease - margin")
        self.engine = engine
        self.holder = holder
        self.name = name
        self.lease_s = lease_s
        self.renew_every_s = renew_every_s
        self.margin_s = margin_s
        self._monotonic = monotonic
        self.term: int | None = None  # the term held, until it ends
        self._until = 0.0  # local monotonic moment this process stops acting as leader
        self._errors = InternalErrors(log, monotonic)

    def leading(self) -> bool:
        """True while a term is held and its lease has not run out by this process's
        estimate."""
        return self.term is not None and self._monotonic() < self._until

    async def step(self) -> bool:
        """Renew the lease held, or try to take a lapsed one; whether this process leads."""
        sent = self._monotonic()
        params = {"name": self.name, "lease_s": self.lease_s}
        if self.term is not None:
            renewed = await fetch(self.engine, _RENEW, {**params, "term": self.term})
            if renewed:
                self._until = sent + self.lease_s - self.margin_s
                return self.leading()
            self.step_down("lease lost")
            return False
        elected = await fetch(self.engine, _ELECT, {**params, "holder": self.holder})
        if not elected:
            return False
        self.term = int(elected[0].term)
        self._until = sent + self.lease_s - self.margin_s
        LEADER.set(1)
        LEADER_TERM.set(self.term)
        log.info("elected leader", extra={"holder": self.holder, "term": self.term})
        return self.leading()

    def step_down(self, why: str) -> None:
        """Stop acting as the leader (the caller stops the duties)."""
        if self.term is not None:
            log.warning("leader stepped down", extra={"holder": self.holder,
                                                      "term": self.term, "why": why})
        self.term = None
        LEADER.set(0)

    async def resign(self) -> None:
        """Give the lease up now (shutdown, after the duties stopped): a follower takes
        over at its next attempt instead of after the lease."""
        term, self.term = self.term, None
        LEADER.set(0)
        if term is not None:
            await fetch_none(self.engine, _RESIGN, {"name": self.name, "term": term})

    async def run(self, duties: Mapping[str, Duty]) -> None:
        """Seek or hold the lease until cancelled, running `duties` (name: factory) while
        leading and cancelling them as the term ends; at the end, stop them and resign."""
        running = Duties(duties)
        try:
            while True:
                await self._attempt()
                if self.leading():
                    assert self.term is not None
                    running.start(self.term)
                else:
                    if self.term is not None:
                        self.step_down("lease ran out before it was renewed")
                    await running.stop()
                wait = self.renew_every_s
                if self.leading():
                    wait = min(wait, self._until - self._monotonic())
                await asyncio.sleep(max(wait, 0.0))
        finally:
            await running.stop()
            try:
                await asyncio.shield(self.resign())
            except Exception as exc:  # the lease then lapses by itself
                if not expected(exc):
                    self._errors.caught(Where.LEADER, exc)

    async def _attempt(self) -> None:
        """One step, abandoned when the lease held runs out by this process's estimate: a
        renewal that hangs must not keep a partitioned leader's duties running."""
        budget = (self._until - self._monotonic()) if self.leading() else self.renew_every_s
        try:
            async with asyncio.timeout(max(budget, 0.0)):
                await self.step()
        except TimeoutError:
            log.warning("leader election step timed out", extra={"holder": self.holder})
        except Exception as exc:
            if expected(exc):
                log.warning("leader election: database unavailable or busy")
            else:
                self._errors.caught(Where.LEADER, exc)


class Duties:
    """The duty tasks of one term: started once per term, stopped (and awaited) before
    anything else happens."""

    def __init__(self, duties: Mapping[str, Duty]) -> None:
        self._duties = dict(duties)
        self._term: int | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, term: int) -> None:
        if self._term == term:
            return
        self._term = term  # run() stops one term's duties before it starts the next
        self._tasks = [asyncio.create_task(duty(term), name=f"leader:{name}")
                       for name, duty in self._duties.items()]
        log.info("leader duties started", extra={"term": term, "duties": sorted(self._duties)})

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        if not tasks:
            return
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        log.info("leader duties stopped", extra={"term": self._term})
        self._term = None
