"""Templates that cannot inject (issue 46, point 3): JSON escaping keeps a body JSON, not
the GraphQL (or SQL, or script) inside one of its strings, so check-config refuses a
placeholder in a string that is code, pointing to the safe form; the safe form (GraphQL
variables) sends the hostile id as one JSON string."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.config.body_templates import SAFE_FORM, code_problem, compile_body
from service.config.placeholders import TemplateProblems
from service.config.policies import resolve_policies
from service.errors import ConfigError
from tests.unit.test_request_templates import QUERY, send, shopify, shopify_doc

# the issue's object id: spliced into the query text, it deletes customer 2 as well
INJECTION = '1") { deletedCustomerId } b: customerDelete(input: {id: "gid://shopify/Customer/2'
SPLICED = ('mutation { customerDelete(input: {id: "gid://shopify/Customer/{object_id}"}) '
           "{ deletedCustomerId userErrors { field message } } }")


def test_the_issues_query_template_is_refused_naming_the_key_and_the_safe_form() -> None:
    doc = shopify_doc(body={"query": SPLICED})
    with pytest.raises(ConfigError) as info:
        resolve_policies(doc, {"TOKEN": "shpat-secret-4242"}, source="p.toml")
    [problem] = info.value.problems
    assert "shpat-secret-4242" not in str(info.value)
    assert problem.startswith("policies file p.toml: policies.erase.body.query: a 'query' "
                              "string is code")
    assert 'variables = { id = "gid://shopify/Customer/{object_id}" }' in problem


@pytest.mark.parametrize(("body", "key"), [
    ({"query": SPLICED}, "body.query"),
    ({"query": "{object_id}"}, "body.query"),  # the whole code from an id
    ({"Mutation": "customerDelete(id: {object_id})"}, "body.Mutation"),
    ({"sql": "DELETE FROM carts WHERE id = '{object_id}'"}, "body.sql"),
    ({"script": "ctx._source.remove('{object_id}')"}, "body.script"),
    ({"requests": [{"statement": "x {tenant_id}"}]}, "body.requests[0].statement"),
    ({"query": ["q1", "q2 {object_id}"]}, "body.query[1]"),  # a list under a code key
    # a GraphQL document under any key, with or without an operation keyword
    ({"q": SPLICED}, "body.q"),
    ({"doc": '{ customer(id: "{object_id}") { id } }'}, "body.doc"),
    ({"doc": "  # a comment\n query Q { node(id: \"{object_id}\") { id } }"}, "body.doc"),
    ({"variables": {"x": 'mutation { a(id: "{object_id}") { id } }'}}, "body.variables.x"),
])
def test_a_placeholder_in_code_is_refused(body: Any, key: str) -> None:
    with pytest.raises(TemplateProblems) as info:
        compile_body(body, {})
    [(named, message)] = info.value.problems
    assert named == key and SAFE_FORM in message


@pytest.mark.parametrize("body", [
    {"query": QUERY, "variables": {"input": {"id": "gid://shopify/Customer/{object_id}"}}},
    {"query": QUERY, "variables": {"id": "{object_id}", "query": "id:{object_id}"}},
    {"id": "{object_id}", "note": "Order {object_id} expired", "shop": "{tenant_id}"},
    {"query": "mutation { x }"},  # code without a placeholder is the policy's own text
    {"ids": ["{object_id}"], "filter": {"id": {"in": ["{object_id}"]}}},
])
def test_data_strings_take_placeholders(body: Any) -> None:
    assert compile_body(body, {})


@pytest.mark.parametrize(("key", "text", "code"), [
    (None, "gid://shopify/Customer/{object_id}", False),
    (None, "{object_id}", False),
    (None, "{ a }", True),
    (None, "query { a }", True),
    (None, "fragment F on C { id }", True),
    (None, "queries {object_id}", False),
    ("QUERY", "anything", True),
    ("queryString", "anything", False),
])
def test_what_counts_as_code(key: str | None, text: str, code: bool) -> None:
    assert (code_problem(key, text) is not None) is code


async def test_the_variables_form_sends_the_injection_as_one_json_string() -> None:
    policies = shopify()  # the query as constant text, the id in variables.input.id
    answer, seen = await send(policies, "acme.myshopify.com", INJECTION)
    assert answer.status == 200
    [request] = seen
    sent = json.loads(request.content)
    assert sent["query"] == QUERY  # the code is the policy's, untouched
    assert sent["variables"]["input"] == {"id": "gid://shopify/Customer/" + INJECTION}
    assert sent["variables"]["raw"] == INJECTION
    assert "customerDelete" not in request.content.decode().replace(QUERY, "").replace(
        json.dumps(INJECTION)[1:-1], "")  # the only other customerDelete is inside the id
