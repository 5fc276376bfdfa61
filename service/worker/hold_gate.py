"""Holds bind at the send: once `POST /v1/holds` has answered, no call it covers starts, not
even one already leased and waiting for a slot, a token's moment or a connection.

The admission skips held items, but a call leased before the hold was placed can still be
waiting in this process. So each call passes this gate in the same synchronous step that
writes its request (the SEND_GATE request extension of service/protocols/transport.py; a
store target's statement likewise): the gate lets it through, and marks it started, unless a
hold this process has learned of covers one of its items, or its lease is about to run out.
A process learns of a hold (`learn`) from a notification sent when the hold commits, or its
poll of the newest hold id (service/worker/pool.py): it revokes the covered calls not yet
started, keeps the hold for the leases its admissions still return (an admission that began
before the hold committed), then acknowledges it in the database, naming the calls it
revoked. The hold answers once every worker holding a covered lease has acknowledged it or
that lease has run out (service/ledger/holds.py), so:
  - no call it covers starts after it answers (a revoked one is handed back unstarted);
  - its `in_flight` names the calls that passed the gate before, and only those, but for a
    worker that never acknowledged (cut off from the database): its covered leases count as
    in flight, the safe side, and their calls cannot start once the lease ends.
All of it runs on the event loop: between a check and its request's write nothing else runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from service.ledger.claims import Lease

# A lease this close to its end (on this process's estimate of the database's clock) starts
# no call: the hold that waits for it to end must be able to count on that.
LEASE_END_MARGIN_S: Final = 0.5
# How long a learned hold is kept: far longer than an admission sent before it was learned
# can take (its statement timeout).
HOLD_MEMORY_S: Final = 300.0


@dataclass(frozen=True)
class HoldCover:
    """What a hold covers, as `statements.hold_covers` says it in SQL."""

    id: int
    tenant_id: str
    policy: str | None
    object_ids: frozenset[str] | None
    object_id_prefix: str | None

    def covers(self, lease: Lease) -> bool:
        return (lease.tenant_id == self.tenant_id
                and self.policy in (None, lease.policy)
                and (self.object_ids is None or lease.object_id in self.object_ids)
                and (self.object_id_prefix is None
                     or lease.object_id.startswith(self.object_id_prefix)))


@dataclass
class _Leased:
    lease: Lease
    ends: float  # the local monotonic moment its lease ends
    started: bool = False


class HoldGate:
    """The leases this process holds, whether each call started, and the holds it learned."""

    def __init__(self) -> None:
        self._leased: dict[int, _Leased] = {}
        self._revoked: dict[int, int] = {}  # item id -> the hold that revoked its call
        # learned holds by tenant, with when (a lease is checked against its tenant's only)
        self._recent: dict[str, list[tuple[float, HoldCover]]] = {}
        self.known: int | None = None  # the newest hold id learned (None: not read yet)

    def leased(self, leases: Iterable[tuple[Lease, float]], began: float) -> None:
        """Leases an admission that was sent at `began` returned, each with its local end.
        One a hold learned after `began` covers is revoked at once: that admission may not
        have seen the hold. (One sent later saw it: a covered lease it returns means the
        hold was released meanwhile.)"""
        for lease, ends in leases:
            self._leased[lease.item_id] = _Leased(lease, ends)
            for learned, hold in self._recent.get(lease.tenant_id, ()):
                if began < learned and hold.covers(lease):
                    self._revoked[lease.item_id] = hold.id
                    break

    def learn(self, holds: Sequence[HoldCover], now: float) -> dict[int, list[int]]:
        """New holds: revoke the covered calls not started; returns the revoked item ids by
        hold (each hold listed), for the acknowledgement."""
        revoked: dict[int, list[int]] = {hold.id: [] for hold in holds}
        self._recent = {tenant: kept for tenant, learned in self._recent.items()
                        if (kept := [(t, h) for t, h in learned if now - t < HOLD_MEMORY_S])}
        for hold in holds:
            self._recent.setdefault(hold.tenant_id, []).append((now, hold))
            for item_id, held in self._leased.items():
                if not held.started and item_id not in self._revoked \
                        and hold.covers(held.lease):
                    self._revoked[item_id] = hold.id
                    revoked[hold.id].append(item_id)
        return revoked

    def gate(self, call: Sequence[Lease], monotonic: Callable[[], float]
             ) -> Callable[[], bool]:
        """The check a call passes right before its request is written: True (and the
        call is started) unless one of its items is revoked or a lease is about to end."""
        def may_send() -> bool:
            if self._revoked and any(lease.item_id in self._revoked for lease in call):
                return False
            latest = monotonic() + LEASE_END_MARGIN_S
            held = []
            for lease in call:  # nearly always one
                h = self._leased.get(lease.item_id)
                if h is None or latest > h.ends:
                    return False
                held.append(h)
            for h in held:
                h.started = True
            return True
        return may_send

    def revoked(self, call: Sequence[Lease]) -> bool:
        """Whether a hold revoked this call (else a withheld call's lease was ending)."""
        return any(lease.item_id in self._revoked for lease in call)

    def finished(self, call: Sequence[Lease]) -> None:
        """The call is done (completed or handed back): its leases leave the gate."""
        for lease in call:
            self._leased.pop(lease.item_id, None)
            self._revoked.pop(lease.item_id, None)
