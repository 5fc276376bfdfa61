"""A call: the items one upstream request (or store statement) carries.

A round's leases become calls (`calls_of`): each alone, or up to a batch policy's
max_objects of one scope. A batch call's Idempotency-Key is the identity of its items
(`batch_key`); a call of one item whose deletion answered success, under a policy that
confirms deletions, is that policy's confirmation read (`is_confirmation_read`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from service.budget.rules import Grant
from service.config.policies import Policy
from service.ledger.claims import Lease

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


def is_confirmation_read(policy: Policy, call: Call) -> bool:
    """Whether `call` is a confirmation read: its one item's deletion answered success and
    its policy confirms deletions (an item whose policy no longer does is deleted again,
    with the same key, and succeeds unconfirmed)."""
    return len(call) == 1 and call[0].confirming and policy.confirm_request is not None


def batch_key(policy: Policy, leases: Sequence[Lease]) -> str:
    """A batch call's Idempotency-Key: the batch's identity, from the policy's version and
    its items' own operation keys in order (the same items sent again send the same key)."""
    digest = hashlib.sha256(f"{policy.name}\x00{policy.version}".encode())
    for key in sorted(lease.operation_key for lease in leases):
        digest.update(b"\x00" + key.encode())
    return digest.hexdigest()
