"""Answer rules (service/config/answer_rules.py): paths, matching, what is recorded, and how the
policies file refuses a rule it cannot use."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from service.config.answer_rules import (
    ANY,
    AnswerRule,
    Costs,
    code_of,
    compile_rules,
    parse_path,
    same_json,
    values_at,
)
from service.config.policies import resolve_policies
from service.errors import ConfigError
from service.outcomes import Answer, Classified, Outcome, classify, plan
from tests.fakes.answer_rules import SHOPIFY

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def rules(specs: list[dict[str, Any]], max_bytes: int = 65536) -> Any:
    return compile_rules([AnswerRule.model_validate(s) for s in specs], max_bytes)


def body(value: Any) -> bytes:
    return json.dumps(value).encode()


@pytest.mark.parametrize(("path", "steps"), [
    ("id", ("id",)),
    ("data.customerDelete.userErrors[0]", ("data", "customerDelete", "userErrors", 0)),
    ("errors[*].extensions.code", ("errors", ANY, "extensions", "code")),
    ("a[1][*][2].b-c_d", ("a", 1, ANY, 2, "b-c_d")),
])
def test_paths_parse_into_steps(path: str, steps: tuple[Any, ...]) -> None:
    assert parse_path(path) == steps


@pytest.mark.parametrize("path", ["", ".", "a..b", "a[", "a[-1]", "a[x]", "a b", "$.a",
                                  "a[1234567]", "ü", ".".join(["a"] * 33)])
def test_unparseable_paths_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match=r"body path|more than"):
        parse_path(path)


def test_values_at_fans_out_over_lists_and_skips_what_is_missing() -> None:
    doc = {"errors": [{"extensions": {"code": "A"}}, {"message": "x"},
                      {"extensions": {"code": "B"}}], "n": [1, 2]}
    assert values_at(doc, parse_path("errors[*].extensions.code")) == ["A", "B"]
    assert values_at(doc, parse_path("errors[1].extensions.code")) == []
    assert values_at(doc, parse_path("n[5]")) == []
    assert values_at(doc, parse_path("n.x")) == []  # a key on a list reaches nothing
    assert values_at([doc], parse_path("errors")) == []  # a key on the top-level list
    assert values_at("text", parse_path("a")) == []


@pytest.mark.parametrize(("a", "b", "same"), [
    (True, True, True), (True, 1, False), (1, True, False), (0, False, False),
    (1, 1.0, True), ("1", 1, False), (None, None, True), ([], [], True), ("a", "a", True)])
def test_json_equality_is_exact(a: Any, b: Any, same: bool) -> None:
    assert same_json(a, b) is same


@pytest.mark.parametrize(("value", "code"), [
    ("NOT_FOUND", "NOT_FOUND"), (404, "404"), ("a.b:c-d", "a.b:c-d"),
    ("Customer can't be found", None), ("x" * 65, None), (True, None), (None, None),
    ({"code": "X"}, None), (1.5, None), ("", None), ("ünï", None)])
def test_only_code_like_values_are_recorded(value: Any, code: str | None) -> None:
    assert code_of(value) == code


@pytest.mark.parametrize(("answer", "outcome", "reason"), [
    ({"errors": [{"message": "Throttled", "extensions": {"code": "THROTTLED"}}]},
     Outcome.THROTTLED, "http_200:throttled"),
    ({"data": {"customerDelete": {"deletedCustomerId": None, "userErrors": [
        {"field": ["id"], "message": "Customer can't be found"}]}}},
     Outcome.SUCCEEDED, "http_200:absent"),
    ({"data": {"customerDelete": {"deletedCustomerId": None, "userErrors": [
        {"field": ["id"], "message": "Customer has orders and cannot be deleted"}]}}},
     Outcome.PERMANENT, "http_200:user_errors:id"),
    ({"data": {"customerDelete": {"deletedCustomerId": None, "userErrors": [
        {"field": None, "message": "Something went wrong"}]}}},
     Outcome.PERMANENT, "http_200:user_errors:no_code"),
    ({"data": {"customerDelete": {"deletedCustomerId": "gid://shopify/Customer/1",
                                  "userErrors": []}}},
     Outcome.SUCCEEDED, "http_200:deleted"),
    ({"data": None, "errors": [{"message": "Internal error"}]},
     Outcome.TRANSIENT, "http_200:no_deletion"),
])
def test_shopify_answers_read_from_the_body(answer: Any, outcome: Outcome, reason: str
                                            ) -> None:
    verdict = rules(SHOPIFY).classify(200, body(answer))
    assert verdict == Classified(outcome, reason)


def test_the_message_text_is_never_recorded() -> None:
    answer = {"data": {"customerDelete": {"userErrors": [
        {"message": "secret-ish text", "field": ["has space"]}]}}}
    verdict = rules(SHOPIFY).classify(200, body(answer))
    assert verdict is not None and "secret" not in verdict.reason
    assert verdict.reason == "http_200:user_errors:no_code"


@pytest.mark.parametrize("raw", [b"not json", b"\xff\xfe", b"[" * 100_000, b"1" * 5000, b""])
def test_a_body_that_is_not_json_matches_no_path_rule(raw: bytes) -> None:
    # the status rule still matches: the last Shopify rule is a catch-all for 200
    assert rules(SHOPIFY).classify(200, raw) == Classified(Outcome.TRANSIENT,
                                                           "http_200:no_deletion")
    assert rules(SHOPIFY[:3]).classify(200, raw) is None


def test_an_unread_body_matches_no_path_rule() -> None:
    assert rules(SHOPIFY[:3]).classify(200, None) is None


def test_other_statuses_are_left_to_the_status_table() -> None:
    compiled = rules(SHOPIFY)
    assert compiled.classify(429, body({"errors": [{"extensions": {"code": "THROTTLED"}}]})) \
        is None
    assert not compiled.wants_body(429) and compiled.wants_body(200)


def test_status_classes_and_lists() -> None:
    compiled = rules([{"status": ["4xx", 500], "outcome": "transient", "reason": "odd"}])
    assert compiled.classify(404, None) == Classified(Outcome.TRANSIENT, "http_404:odd")
    assert compiled.classify(500, None) is not None
    assert compiled.classify(502, None) is None
    assert not compiled.wants_body(404)  # no rule reads a body


def test_a_path_rule_without_a_status_reads_every_body() -> None:
    compiled = rules([{"path": "ok", "equals": True, "outcome": "succeeded"}])
    assert compiled.wants_body(503) and compiled.wants_body(200)
    assert compiled.classify(503, body({"ok": True})) == Classified(Outcome.SUCCEEDED,
                                                                    "http_503:rule1")
    assert compiled.classify(503, body({"ok": 1})) is None


def test_present_false_holds_when_the_path_reaches_nothing_or_null() -> None:
    compiled = rules([{"path": "data.id", "present": False, "outcome": "permanent"}])
    assert compiled.classify(200, body({"data": {"id": None}})) is not None
    assert compiled.classify(200, body({"data": {}})) is not None
    assert compiled.classify(200, body({"data": {"id": 0}})) is None


def test_a_conflict_names_the_version_to_retry_with() -> None:
    compiled = rules([{"status": 409, "path": "errors[*].code",
                       "equals": "ConcurrentModification", "outcome": "transient",
                       "reason": "conflict", "version": "errors[*].currentVersion"}])
    conflict = {"statusCode": 409, "errors": [{"code": "ConcurrentModification",
                                               "currentVersion": 7}]}
    assert compiled.classify(409, body(conflict)) == Classified(
        Outcome.TRANSIENT, "http_409:conflict", version="7")
    del conflict["errors"][0]["currentVersion"]  # type: ignore[attr-defined]
    assert compiled.classify(409, body(conflict)) == Classified(
        Outcome.TRANSIENT, "http_409:conflict:no_version")


def test_a_conflict_is_retried_at_once_and_counts_as_an_attempt() -> None:
    conflict = Classified(Outcome.TRANSIENT, "http_409:conflict", version="7")
    now = plan(conflict, attempt=1, max_attempts=3, backoff_base_s=10, backoff_max_s=60,
               retry_after_max_s=60, jitter=0.9)
    assert (now.status, now.retry_in_seconds, now.refund_attempt) == ("pending", 0.0, False)
    last = plan(conflict, attempt=3, max_attempts=3, backoff_base_s=10, backoff_max_s=60,
                retry_after_max_s=60, jitter=0.9)
    assert (last.status, last.reason) == ("dead", "max_attempts:http_409:conflict")


def test_a_ruled_throttle_takes_the_answers_retry_after() -> None:
    ruled = Classified(Outcome.THROTTLED, "http_200:throttled")
    got = classify(Answer(status=200, retry_after="7"), absent_means_deleted=False, now=NOW,
                   ruled=ruled)
    assert got == Classified(Outcome.THROTTLED, "http_200:throttled", 7.0)
    # a failure is never ruled: there was no answer to read
    failed = classify(Answer(status=None), absent_means_deleted=False, now=NOW, ruled=ruled)
    assert failed.outcome is Outcome.UNKNOWN


@pytest.mark.parametrize(("spec", "message"), [
    ({"outcome": "permanent"}, "needs a status, a path, or both"),
    ({"path": "a", "outcome": "permanent"}, "exactly one of equals or present"),
    ({"path": "a", "equals": 1, "present": True, "outcome": "permanent"}, "exactly one"),
    ({"status": 200, "equals": 1, "outcome": "permanent"}, "add a path"),
    ({"path": "a b", "present": True, "outcome": "permanent"}, "is not a body path"),
    ({"status": 200, "outcome": "gone"}, "Input should be"),
    ({"status": 99, "outcome": "permanent"}, "greater than or equal to 100"),
    ({"status": "6xx", "outcome": "permanent"}, "Input should be"),
    ({"status": [], "outcome": "permanent"}, "at least one status"),
    ({"status": 409, "outcome": "permanent", "version": "v"}, "goes with outcome 'transient'"),
    ({"status": 200, "outcome": "permanent", "reason": "Has Space"}, "should match pattern"),
    ({"status": 200, "outcome": "permanent", "message": "x"}, "Extra inputs"),
])
def test_a_rule_that_cannot_work_is_refused(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as refused:
        AnswerRule.model_validate(spec)
    assert message in str(refused.value)


def policies_with(**policy: Any) -> dict[str, Any]:
    return {"upstreams": {"api": {"base_url": "https://api.example.com"}},
            "policies": {"p": {"version": 1, "upstream": "api", "path": "/c/{object_id}",
                               "rate": {"per_second": 1}, **policy}}}


def test_the_policies_file_names_the_rule_key_at_start_up() -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(policies_with(answers=[
            {"status": 200, "outcome": "succeeded"},
            {"path": "x[", "present": True, "outcome": "permanent"}]), {}, source="f.toml")
    assert refused.value.problems == (
        "policies file f.toml: policies.p.answers[1].path: 'x[' is not a body path such as "
        "'data.customerDelete.userErrors[0]' or 'errors[*].extensions.code'",)


def test_a_version_rule_needs_a_request_that_carries_the_version() -> None:
    conflict = {"status": 409, "path": "errors[*].code", "equals": "ConcurrentModification",
                "outcome": "transient", "version": "errors[0].currentVersion"}
    with pytest.raises(ConfigError) as refused:
        resolve_policies(policies_with(answers=[conflict]), {}, source="f.toml")
    assert "policies.p.answers[0].version: the request must carry {object_version}" in \
        refused.value.problems[0]
    ok = resolve_policies(policies_with(answers=[conflict],
                                        path="/c/{object_id}?version={object_version}"),
                          {}, source="f.toml")
    template = ok.policies["p"].request
    assert template.target("t", "c1", "7") == ("/c/c1", "version=7")


@pytest.mark.parametrize("bad", ["..", ".", "", "a b", "x" * 65])
def test_initial_object_version_is_code_like(bad: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(policies_with(initial_object_version=bad), {}, source="f.toml")
    assert "policies.p.initial_object_version" in refused.value.problems[0]


@pytest.mark.parametrize("size", [1023, 1024 * 1024 + 1])
def test_the_body_cap_is_bounded(size: int) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(policies_with(answer_max_bytes=size), {}, source="f.toml")
    assert "policies.p.answer_max_bytes" in refused.value.problems[0]


def test_costs_are_read_from_every_answer() -> None:
    compiled = compile_rules([], actual_cost="extensions.cost.actualQueryCost",
                             available_cost="extensions.cost.throttleStatus.currentlyAvailable")
    assert compiled.wants_body(200) and compiled.wants_body(503)
    answer = {"extensions": {"cost": {"actualQueryCost": 4, "throttleStatus": {
        "currentlyAvailable": 1996.5}}}}
    assert compiled.read(200, body(answer)).costs == Costs(4.0, 1996.5)
    # throttled: no actual cost; what is not a number is not read
    throttled = {"extensions": {"cost": {"actualQueryCost": None, "throttleStatus": {
        "currentlyAvailable": "lots"}}}}
    assert compiled.read(200, body(throttled)).costs == Costs(None, None)
    assert compiled.read(200, b"garbage").costs == Costs(None, None)
    assert compiled.read(200, body({"extensions": {"cost": {"actualQueryCost": -1}}})
                         ).costs == Costs(None, None)


@pytest.mark.parametrize(("policy", "key"), [
    ({"rate": {"per_second": 100, "burst": 1000, "unit": "points"}}, "policies.p.cost"),
    ({"cost": {"requested": 10}}, "policies.p.rate.unit"),
    ({"rate": {"per_second": 100, "burst": 5, "unit": "points"}, "cost": {"requested": 10}},
     "policies.p.cost.requested"),
    ({"rate": {"per_second": 100, "burst": 1000, "unit": "points"},
      "cost": {"requested": 10, "actual": "a..b"}}, "policies.p.cost.actual"),
])
def test_a_cost_budget_that_cannot_work_is_refused(policy: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(policies_with(**policy), {}, source="f.toml")
    assert refused.value.problems[0].startswith(f"policies file f.toml: {key}:")


def test_a_number_no_float_holds_is_no_cost() -> None:
    compiled = compile_rules([], actual_cost="cost", available_cost="left")
    huge = b'{"cost": 1' + b"0" * 400 + b', "left": 1e400}'
    assert compiled.read(200, huge).costs == Costs(None, None)


@pytest.mark.parametrize("version", [".", ".."])
def test_a_dot_version_is_no_version(version: str) -> None:
    """`.` and `..` are code-like, but no path segment: the item backs off instead of
    dying on a URL it cannot make."""
    compiled = rules([{"status": 409, "outcome": "transient", "reason": "conflict",
                       "version": "currentVersion"}])
    assert compiled.classify(409, body({"currentVersion": version})) == Classified(
        Outcome.TRANSIENT, "http_409:conflict:no_version")
