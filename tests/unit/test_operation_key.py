"""The operation key is an item's identity at the upstream (its Idempotency-Key): it must
never change for the same obligation, across releases, or a retry would look new."""

from __future__ import annotations

import hashlib

from service.ledger.registration import operation_key, operation_keys


def test_known_vectors_never_change() -> None:
    # sha256 over length-prefixed (4-byte big-endian) UTF-8 fields: tenant, object, policy,
    # version; recorded when the format was fixed
    assert operation_key("acme", "cart-1", "carts", 1) == (
        "e8342389f10a0f4ccbed6ea18fead6fb0ab56156286fa819dc418bd3d7218c60")
    fields = [f.encode() for f in ("ünï", "a/b?c#d", "p", "12")]
    spelled_out = b"".join(len(f).to_bytes(4, "big") + f for f in fields)
    assert operation_key("ünï", "a/b?c#d", "p", 12) == hashlib.sha256(spelled_out).hexdigest()


def test_fields_cannot_run_into_each_other() -> None:
    assert operation_key("ab", "c", "p", 1) != operation_key("a", "bc", "p", 1)
    assert operation_key("a", "b", "p", 11) != operation_key("a", "b", "p1", 1)


def test_a_batch_derives_each_key_as_one_key_alone() -> None:
    tenants = ["acme", "acme", "ünï", "acme", "", "globex"]
    objects = ["c1", "c2", "c1", "c1", "x", "c1"]
    policies = ["carts", "carts", "carts", "orders", "carts", "carts"]
    versions = [1, 1, 1, 1, 1, 2]
    assert operation_keys(tenants, objects, policies, versions) == [
        operation_key(*fields) for fields in zip(tenants, objects, policies, versions,
                                                 strict=True)]
    assert operation_keys([], [], [], []) == []
