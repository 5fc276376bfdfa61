"""Confirmation reads: what a policy's `confirm` accepts and how it refuses, which items
a share chooses, and how a read's answer is classified (never a success unless absent)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from service.config.policies import Policies, resolve_policies
from service.errors import ConfigError
from service.ledger.registration import operation_key
from service.outcomes import Answer, Failure, Outcome, classify_confirmation

NOW = datetime(2026, 12, 5, tzinfo=UTC)
CONFIRM = {"path": "/carts/{object_id}", "absent": [404, 410], "share": 1.0}


def doc(confirm: Any = CONFIRM, **policy: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                           "scope": "tenant:{tenant_id}", "rate": {"per_second": 10},
                           "confirm": confirm}
    cfg.update(policy)
    return {"upstreams": {"shop": {"base_url": "https://shop.example"}},
            "policies": {"carts": cfg}}


def resolved(d: dict[str, Any]) -> Policies:
    return resolve_policies(d, {}, source="p.toml")


def refused(d: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        resolved(d)
    return str(info.value)


def test_a_confirmation_read_compiles_under_the_policys_upstream() -> None:
    policy = resolved(doc({"path": "/v2/carts/{object_id}?tenant={tenant_id}"}))
    policy_cfg = policy.policies["carts"]
    assert policy_cfg.config.confirm is not None
    assert policy_cfg.config.confirm.method == "GET"
    assert policy_cfg.config.confirm.absent == [404, 410]  # the default
    assert policy_cfg.confirm_request is not None
    assert policy_cfg.confirm_request.target("acme", "a/b") == ("/v2/carts/a%2Fb",
                                                                 "tenant=acme")
    assert resolved(doc(None)).policies["carts"].confirm_request is None


@pytest.mark.parametrize(("confirm", "key", "words"), [
    ({**CONFIRM, "absent_statuses": [404]}, "policies.carts.confirm.absent_statuses",
     "unknown key"),
    ({**CONFIRM, "method": "DELETE"}, "policies.carts.confirm.method", "'GET'"),
    ({**CONFIRM, "method": "HEAD"}, "policies.carts.confirm.method", "'GET'"),
    ({"absent": [404]}, "policies.carts.confirm.path", "required key is missing"),
    ({**CONFIRM, "path": "/carts/all"}, "policies.carts.confirm.path", "{object_id}"),
    ({**CONFIRM, "path": "carts/{object_id}"}, "policies.carts.confirm.path", "start with"),
    ({**CONFIRM, "path": "/carts/{object_id}/{secret}"}, "policies.carts.confirm.path",
     "unknown placeholder"),
    ({**CONFIRM, "path": "/carts/{object_id}?ids={object_ids}"},
     "policies.carts.confirm.path", "reads one object"),
    ({**CONFIRM, "absent": []}, "policies.carts.confirm.absent", "at least 1"),
    ({**CONFIRM, "absent": list(range(400, 409))}, "policies.carts.confirm.absent",
     "at most 8"),
    ({**CONFIRM, "absent": [200]}, "policies.carts.confirm.absent", "cannot mean absent"),
    ({**CONFIRM, "absent": [404, 429]}, "policies.carts.confirm.absent",
     "cannot mean absent"),
    ({**CONFIRM, "absent": [403]}, "policies.carts.confirm.absent", "cannot mean absent"),
    ({**CONFIRM, "absent": [503]}, "policies.carts.confirm.absent", "cannot mean absent"),
    ({**CONFIRM, "absent": [404, 404]}, "policies.carts.confirm.absent", "twice"),
    ({**CONFIRM, "share": 1.5}, "policies.carts.confirm.share", "less than or equal to 1"),
    ({**CONFIRM, "share": -0.1}, "policies.carts.confirm.share",
     "greater than or equal to 0"),
])
def test_each_fault_of_a_confirmation_read_is_refused_with_its_key(
        confirm: dict[str, Any], key: str, words: str) -> None:
    message = refused(doc(confirm))
    line = next((x for x in message.splitlines() if key in x), message)
    assert key in line and words in line, message


def test_batch_policies_and_store_targets_refuse_a_confirmation_read() -> None:
    batch = doc(path="/carts?ids={object_ids}", batch={"max_objects": 10},
                scope="{policy}:{tenant_id}")
    assert "policies.carts.confirm: a confirmation reads one object" in refused(batch)
    store = {"stores": {"db": {"dsn_env": "DB"}}, "policies": {"carts": {
        "version": 1, "scope": "store:{upstream}:{policy}", "rate": {"per_second": 10},
        "target": {"store": "db", "statement":
                   "DELETE FROM carts WHERE id = ANY(CAST(:object_ids AS bigint[])) "
                   "AND updated_at < :cutoff RETURNING id"},
        "confirm": CONFIRM}}}
    with pytest.raises(ConfigError) as info:
        resolve_policies(store, {"DB": "postgresql://x@h/db"}, source="p.toml")
    assert "policies.carts.confirm: a confirmation read is for an upstream's deletions, " \
           "not supported with a store target" in str(info.value)


def test_a_share_chooses_by_operation_key_the_same_every_time() -> None:
    keys = [operation_key("acme", f"cart-{i}", "carts", 1) for i in range(2000)]
    half = resolved(doc({**CONFIRM, "share": 0.5})).policies["carts"]
    chosen = [k for k in keys if half.confirms(k)]
    assert 900 < len(chosen) < 1100
    assert chosen == [k for k in keys if half.confirms(k)]  # a retry decides the same
    # a larger share confirms a superset: raising it never unconfirms an item
    more = resolved(doc({**CONFIRM, "share": 0.8})).policies["carts"]
    assert set(chosen) < {k for k in keys if more.confirms(k)}
    every = resolved(doc(CONFIRM)).policies["carts"]
    none = resolved(doc({**CONFIRM, "share": 0.0})).policies["carts"]
    assert all(every.confirms(k) for k in keys) and not any(none.confirms(k) for k in keys)
    assert not resolved(doc(None)).policies["carts"].confirms(keys[0])


@pytest.mark.parametrize(("answer", "outcome", "reason"), [
    (Answer(status=404), Outcome.SUCCEEDED, "confirmed:http_404"),
    (Answer(status=410), Outcome.SUCCEEDED, "confirmed:http_410"),
    (Answer(status=200), Outcome.TRANSIENT, "not_confirmed"),
    (Answer(status=204), Outcome.TRANSIENT, "not_confirmed"),
    (Answer(status=429, retry_after="3"), Outcome.THROTTLED, "confirm:http_429"),
    (Answer(status=503), Outcome.TRANSIENT, "confirm:http_503"),
    (Answer(status=401), Outcome.UNAUTHORIZED, "confirm:http_401"),
    (Answer(status=400), Outcome.PERMANENT, "confirm:http_400"),
    (Answer(status=301, location="https://x"), Outcome.PERMANENT,
     "confirm:http_301:redirect:https://x"),
    (Answer(failure=Failure.TIMEOUT_AFTER_SEND), Outcome.UNKNOWN,
     "confirm:timeout_after_send"),
    (Answer(failure=Failure.CONNECT), Outcome.TRANSIENT, "confirm:connect_error"),
    (Answer(failure=Failure.ECHO_MISMATCH), Outcome.UNKNOWN, "confirm:echo_mismatch"),
    (Answer(), Outcome.UNKNOWN, "confirm:no_status"),
])
def test_a_read_is_a_success_only_when_it_finds_the_object_absent(
        answer: Answer, outcome: Outcome, reason: str) -> None:
    got = classify_confirmation(answer, absent=(404, 410), now=NOW)
    assert (got.outcome, got.reason) == (outcome, reason)


def test_a_status_not_listed_as_absent_confirms_nothing() -> None:
    got = classify_confirmation(Answer(status=404), absent=(410,), now=NOW)
    assert got.outcome is Outcome.PERMANENT and got.reason == "confirm:http_404"
