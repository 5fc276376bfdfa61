"""service/protocols/strict_json: what Python's reader takes and JSON does not say one way."""

from __future__ import annotations

import json

import pytest

from service.protocols import strict_json


@pytest.mark.parametrize(("text", "why"), [
    ('{"dry_run": true, "dry_run": false}', "the key 'dry_run' appears twice in one object"),
    ('{"items": [{"a": 1, "b": 2, "a": 1}]}', "the key 'a' appears twice in one object"),
    ('{"rate": NaN}', "NaN is not JSON"),
    ("[Infinity]", "Infinity is not JSON"),
    ('{"a": -Infinity}', "-Infinity is not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"rate": 1e999}', "the number 1e999 is out of range"),
    ('{"max_items": ' + "9" * 5000 + "}", "a number has too many digits"),
])
def test_what_is_refused_and_why(text: str, why: str) -> None:
    with pytest.raises(strict_json.NotJson) as refused:
        strict_json.loads(text.encode())
    assert str(refused.value) == why


def test_json_itself_reads_as_json_does() -> None:
    text = '{"a": {"a": 1}, "b": [1.5, "NaN", null, {"c": true}], "\\u00e9": 1e308}'
    assert strict_json.loads(text) == json.loads(text)


def test_a_syntax_error_is_json_s_own() -> None:
    with pytest.raises(json.JSONDecodeError):
        strict_json.loads('{"a": tru}')
