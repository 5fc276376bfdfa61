"""JSON body templates: a policy's (or a list source's) `body`, compiled once into JSON text
with slots for the item's fields, and filled per call.

Values go in as JSON values. A string that is exactly one placeholder becomes the value
itself (a JSON string; `policy_version` a number); placeholders among text are substituted
inside that JSON string; keys are sent as written. A value full of quotes and braces stays a
string: it is JSON-encoded, never spliced into JSON text. JSON escaping protects the JSON,
not code inside a string, so no placeholder may go in a string that is code: under a key of
CODE_KEYS (`query`, `mutation`, `sql`, ...; outside the top-level `variables`, which are
data whatever their names) or reading as a GraphQL document; values go in data (GraphQL
`variables`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import date, datetime, time
from typing import Any, Final, NamedTuple

from service.config.placeholders import (
    PLACEHOLDER,
    REQUEST_FIELDS,
    TemplateProblems,
    unknown_placeholders,
)
from service.protocols import strict_json


class Slot(NamedTuple):
    """Where an item's field goes in the body: the whole JSON value, or inside a string."""

    name: str
    whole: bool


BodyPieces = tuple[str | Slot, ...]  # JSON text between the slots
BodyValue = str | int | list[str] | None


def parse_json_body(text: str) -> Any:
    """A body written as JSON text: an object or array, read by strict_json."""
    try:
        value = strict_json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, (dict, list)):
        raise ValueError("must be a JSON object or array")
    return value


def body_value(value: Any) -> Any:
    """A policy file's `body` as a validator reads it: a table or an array (the JSON body
    itself), or JSON text, parsed."""
    if isinstance(value, str):
        return parse_json_body(value)
    if value is not None and not isinstance(value, (dict, list)):
        raise ValueError("must be a table or an array (the JSON body), or JSON text")
    return value


# Keys whose string is code for the upstream to run, not data: a value spliced into one can
# change what runs (JSON escaping keeps the body JSON, not the code inside it). Compared
# case-insensitively; a list under such a key is code too.
CODE_KEYS: Final = frozenset({"query", "mutation", "subscription", "sql", "statement",
                              "script", "code", "expression", "command"})
# A string that reads as a GraphQL document once its placeholders are taken out: an
# operation keyword or a selection set's brace first (after comments), and a closing brace.
_GRAPHQL: Final = re.compile(
    r"\A(?:\s|,|#[^\n]*)*(?:(?:query|mutation|subscription|fragment)\b[^{}]*)?\{.*\}",
    re.DOTALL)
SAFE_FORM: Final = ('pass the value as data, e.g. a GraphQL variable: variables = '
                    '{ id = "gid://shopify/Customer/{object_id}" } and $id in the query')


def code_problem(key: str | None, text: str) -> str | None:
    """Why a placeholder may not go in `text`, the string under `key` (None: no key counts,
    as inside GraphQL `variables`), or None: it is code (a key of CODE_KEYS, or a GraphQL
    document), where an id could add an operation."""
    if key is not None and key.lower() in CODE_KEYS:
        meaning = f"a {key!r} string is code"
    elif _GRAPHQL.match(PLACEHOLDER.sub("", text)):
        meaning = "this string reads as a GraphQL document, which is code"
    else:
        return None
    return (f"{meaning}: a placeholder in it would splice an id into the code (JSON escaping "
            f"keeps the body JSON, not the code inside it); {SAFE_FORM}")


def compile_body(template: Any, constants: Mapping[str, str | int],
                 allowed: Sequence[str] = REQUEST_FIELDS) -> BodyPieces:
    """The body template as JSON text with slots for the item's fields (the policy's are
    filled in now); TemplateProblems naming each faulty key under `body`. `allowed` are the
    placeholders it may hold (a list source's differ: service/config/list_sources.py). No
    placeholder may go where a string is code (`code_problem`)."""
    compiler = _BodyCompiler(constants, tuple(allowed))
    try:
        compiler.value(template, "body")
    except RecursionError:
        compiler.problems.append(("body", "nested too deeply"))
    if compiler.problems:
        raise TemplateProblems(compiler.problems)
    merged: list[str | Slot] = []
    for piece in compiler.out:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return tuple(merged)


def _key_path(at: str, key: str) -> str:
    return f"{at}.{key}" if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f"{at}.{json.dumps(key)}"


def _literal_string(text: str) -> str:
    return json.dumps(text)[1:-1]


def _in_variables(at: str) -> bool:
    # GraphQL variables are data whatever their names (a `query` variable included)
    return at.startswith("body.variables.") or at.startswith("body.variables[")


class _BodyCompiler:
    """One walk over a body template: the JSON text and slots so far, and every problem."""

    def __init__(self, constants: Mapping[str, str | int], allowed: tuple[str, ...]) -> None:
        self.constants = constants
        self.allowed = allowed
        self.out: list[str | Slot] = []
        self.problems: list[tuple[str, str]] = []

    def value(self, value: Any, at: str, key: str | None = None) -> None:
        # tables and arrays inline: one frame per level of nesting, as deep as Python goes
        if isinstance(value, dict):
            self.out.append("{")
            for n, (name, item) in enumerate(value.items()):
                if PLACEHOLDER.search(name):
                    self.problems.append((_key_path(at, name), "a key is sent as written, "
                                                              "never filled in: put the "
                                                              "placeholder in a value"))
                self.out.append(("," if n else "") + json.dumps(name) + ":")
                self.value(item, _key_path(at, name), name)
            self.out.append("}")
        elif isinstance(value, list):
            self.out.append("[")
            for n, item in enumerate(value):
                if n:
                    self.out.append(",")
                self.value(item, f"{at}[{n}]", key)
            self.out.append("]")
        elif isinstance(value, str):
            self.string(value, at, None if _in_variables(at) else key)
        else:
            self.atom(value, at)

    def atom(self, value: Any, at: str) -> None:
        """A boolean, number or null; anything else has no JSON form."""
        if isinstance(value, (bool, int)) or value is None:
            self.out.append(json.dumps(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                self.problems.append((at, f"{value} has no JSON form"))
            self.out.append(json.dumps(value))
        elif isinstance(value, (datetime, date, time)):
            self.problems.append((at, "a TOML date or time has no JSON form: write it as a "
                                      "string"))
        else:
            self.problems.append((at, f"a {type(value).__name__} has no JSON form"))

    def string(self, text: str, at: str, key: str | None) -> None:
        names = PLACEHOLDER.findall(text)
        problem = unknown_placeholders(set(names), self.allowed)
        if problem:
            self.problems.append((at, problem + " (a placeholder is {name}; any other brace "
                                                "is text, e.g. a GraphQL selection '{ id }')"))
            return
        problem = code_problem(key, text) if names else None
        if problem:
            self.problems.append((at, problem))
            return
        whole = PLACEHOLDER.fullmatch(text)
        if whole:
            name = whole[1]
            self.out.append(json.dumps(self.constants[name]) if name in self.constants
                            else Slot(name, whole=True))
            return
        self.out.append('"')
        at_char = 0
        for found in PLACEHOLDER.finditer(text):
            self.out.append(_literal_string(text[at_char:found.start()]))
            name = found[1]
            self.out.append(_literal_string(str(self.constants[name]))
                            if name in self.constants else Slot(name, whole=False))
            at_char = found.end()
        self.out.append(_literal_string(text[at_char:]) + '"')


def fill_body(pieces: Sequence[str | Slot], values: Mapping[str, BodyValue]) -> bytes:
    """A compiled body with its slots filled: a whole-string slot becomes the JSON value
    itself (a string, a number, an array; None is null); inside a longer string the value's
    text goes in (a list joined with commas, None as nothing)."""
    parts = []
    for piece in pieces:
        if isinstance(piece, str):
            parts.append(piece)
            continue
        value = values[piece.name]
        if piece.whole:
            parts.append(json.dumps(value))
        else:
            text = "" if value is None else value if isinstance(value, str) else (
                str(value) if isinstance(value, int) else ",".join(value))
            parts.append(json.dumps(text)[1:-1])
    return "".join(parts).encode("ascii")
