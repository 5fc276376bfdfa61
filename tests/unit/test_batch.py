"""Many objects per call: {object_ids} in templates, the policies file's rules for a batch
policy, and how a round's leases become calls."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from service.budget.rules import Grant
from service.config.policies import resolve_policies
from service.errors import ConfigError
from service.ledger.claims import Lease
from service.worker.calls import batch_key, calls_of

HOSTILE = ['1"}, "x": {"', "a,b", "a/../b?c=d#e", "ünï", "%2F"]


def doc(**policy: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"version": 1, "upstream": "api", "method": "DELETE",
                           "path": "/{tenant_id}/customers?id:in={object_ids}",
                           "scope": "{policy}:{tenant_id}", "rate": {"per_second": 5},
                           "batch": {"max_objects": 250}}
    cfg.update(policy)
    return {"upstreams": {"api": {"base_url": "https://api.example.com/stores"}},
            "policies": {"p": {k: v for k, v in cfg.items() if v is not None}}}


def problems(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(document, {}, source="f.toml")
    return [p.removeprefix("policies file f.toml: ") for p in refused.value.problems]


def test_object_ids_go_into_the_query_each_encoded_and_comma_joined() -> None:
    policy = resolve_policies(doc(), {}, source="f.toml").policies["p"]
    path, query = policy.request.target("abc123", "", object_ids=["1", "2", "a,b", "x y"])
    assert (path, query) == ("/stores/abc123/customers", "id:in=1,2,a%2Cb,x%20y")


def test_object_ids_go_into_a_body_as_a_json_array_of_strings() -> None:
    policy = resolve_policies(doc(method="POST", path="/{tenant_id}/customers/delete",
                                  body={"ids": "{object_ids}", "note": "ids {object_ids}"}),
                              {}, source="f.toml").policies["p"]
    body = policy.request.body("abc123", "", object_ids=HOSTILE)
    assert body is not None
    sent = json.loads(body)
    assert sent["ids"] == HOSTILE  # each a JSON string, whatever it holds
    assert sent["note"] == "ids " + ",".join(HOSTILE)


@pytest.mark.parametrize(("policy", "expected"), [
    ({"path": "/{tenant_id}/customers/{object_id}"},
     "policies.p.path: a policy with batch must send {object_ids}"),
    ({"path": "/{tenant_id}/c/{object_id}?id:in={object_ids}"},
     "policies.p.path: {object_id} names one object"),
    ({"path": "/{tenant_id}/c?id:in={object_ids}&v={object_version}"},
     "policies.p.path: {object_version} names one object"),
    ({"batch": None}, "policies.p.path: {object_ids} is for a policy with batch"),
    ({"scope": "store:{tenant_id}"}, "policies.p.scope: a policy with batch needs a scope "
                                     "holding {tenant_id} and {policy}"),
    ({"batch": {"max_objects": 1}}, "policies.p.batch.max_objects: Input should be greater"),
    ({"batch": {"max_objects": 1001}}, "policies.p.batch.max_objects: Input should be less"),
    ({"batch": {"max_objects": 5, "failed": "errors[*"}}, "policies.p.batch.failed: "),
])
def test_a_batch_policy_that_cannot_work_is_refused(policy: dict[str, Any], expected: str
                                                    ) -> None:
    found = problems(doc(**policy))
    assert any(p.startswith(expected) for p in found), found


def lease(n: int, scope: str = "p:abc") -> Lease:
    return Lease(n, "abc", str(n), "p", 1, f"{n:064x}", scope, uuid.uuid4(), 1,
                 datetime.now(UTC))


def test_a_rounds_leases_become_calls_of_at_most_per_call() -> None:
    leases = [lease(n) for n in range(7)] + [lease(100 + n, "single") for n in range(2)]
    grants = {"p:abc": Grant("p:abc", 3, 0.0, per_call=3), "single": Grant("single", 2, 0.0)}
    calls = calls_of(leases, grants)
    assert [[x.item_id for x in call] for call in calls] == [
        [0, 1, 2], [3, 4, 5], [100], [101], [6]]
    only_single = {"single": Grant("single", 2, 0.0)}
    assert calls_of(leases[7:], only_single) == [(leases[7],), (leases[8],)]


def test_calls_of_many_items_are_scheduled_from_the_claims_end() -> None:
    # a claim of many rows is not late for the database's work of locking them; a claim of
    # single-item calls that answers late is (its tokens go back rather than bunch)
    many = Grant("p:abc", 2, 0.0, granted_at=100.0, per_call=500, claimed_at=100.08)
    single = Grant("single", 2, 0.0, granted_at=100.0, claimed_at=100.08)
    assert many.schedule_start == 100.08 and single.schedule_start == 100.0
    assert Grant("p:abc", 2, 0.0, granted_at=100.0, per_call=500).schedule_start == 100.0


def test_a_batch_key_is_the_identity_of_its_items() -> None:
    policy = resolve_policies(doc(), {}, source="f.toml").policies["p"]
    a, b, c = lease(1), lease(2), lease(3)
    assert batch_key(policy, [a, b]) == batch_key(policy, [b, a])
    assert batch_key(policy, [a, b]) != batch_key(policy, [a, c])
    assert len(batch_key(policy, [a])) == 64
