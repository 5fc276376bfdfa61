"""The send gate's bookkeeping (service/worker/hold_gate.py), on its own: which calls a hold
takes back, which it leaves in flight, and the leases that arrive after it was learned."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from service.ledger.claims import Lease
from service.worker.hold_gate import LEASE_END_MARGIN_S, HoldCover, HoldGate


def lease(item_id: int, tenant: str = "acme", object_id: str = "o", policy: str = "carts"
          ) -> Lease:
    return Lease(item_id, tenant, object_id, policy, 1, f"k{item_id}", f"tenant:{tenant}",
                 uuid.uuid4(), 1, datetime(2026, 1, 1, tzinfo=UTC))


HOLD = HoldCover(7, "acme", None, frozenset({"o", "p"}), None)


def test_a_hold_takes_back_what_it_covers_and_has_not_started() -> None:
    gate = HoldGate()
    started, waiting, other, elsewhere = lease(1), lease(2, object_id="p"), lease(3), \
        lease(4, tenant="globex")
    gate.leased([(c, 100.0) for c in (started, waiting, other, elsewhere)], began=0.0)
    assert gate.gate((started,), lambda: 1.0)()
    other_id = HoldCover(8, "acme", "exports", None, None)  # another policy's items
    assert gate.learn([HOLD, other_id], now=1.0) == {7: [2, 3], 8: []}
    assert not gate.gate((waiting,), lambda: 2.0)() and gate.revoked((waiting,))
    assert gate.gate((elsewhere,), lambda: 2.0)() and not gate.revoked((elsewhere,))
    # a batch call with one revoked item is withheld whole
    assert not gate.gate((elsewhere, other), lambda: 2.0)()


def test_a_lease_from_an_admission_sent_before_the_hold_was_learned_is_taken_back() -> None:
    gate = HoldGate()
    assert gate.learn([HOLD], now=5.0) == {7: []}
    late = lease(5)
    gate.leased([(late, 100.0)], began=4.0)  # its statement may not have seen the hold
    assert not gate.gate((late,), lambda: 6.0)() and gate.revoked((late,))
    gate.finished((late,))
    # an admission sent after saw the hold: a covered lease means it was released since
    gate.leased([(late, 100.0)], began=6.0)
    assert gate.gate((late,), lambda: 7.0)()


def test_no_call_starts_near_its_lease_end_or_after_it_finished() -> None:
    gate = HoldGate()
    call = (lease(6, tenant="globex"),)
    gate.leased([(call[0], 50.0)], began=0.0)
    assert not gate.gate(call, lambda: 50.0 - LEASE_END_MARGIN_S + 0.01)()
    assert not gate.revoked(call)  # withheld for its lease, not a hold
    assert gate.gate(call, lambda: 49.0)()
    gate.finished(call)
    assert not gate.gate(call, lambda: 1.0)()  # not (or no longer) leased here
