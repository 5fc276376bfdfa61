"""The placeholders of a policy's templates: the fields a template may name, str.format
templates (base_url, path, query, header values, scopes) parsed and filled in part, a value
percent-encoded as exactly one path segment or query value, and `TemplateProblems`, every
fault of a template by key.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Final
from urllib.parse import quote

FIELDS: Final = ("tenant_id", "object_id", "policy", "policy_version", "upstream")
ITEM_FIELDS: Final = frozenset({"tenant_id", "object_id"})  # the rest are the policy's
# The path, query and body may also carry the object's version for an optimistic-concurrency
# API: the policy's initial_object_version, then the one a conflict answer named.
REQUEST_FIELDS: Final = (*FIELDS, "object_version", "object_ids")
# A policy that sends many objects per call names them all with {object_ids}: in a path or
# query the ids percent-encoded and joined with commas, in a body a JSON array of strings
# (inside a longer string, joined with commas).
DOT_SEGMENTS: Final = frozenset((".", ".."))
# a placeholder where a template is JSON or query text: `{name}`; any other brace is text
PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def segment(value: str) -> str:
    """`value` percent-encoded as one path segment or query value: every character but the
    unreserved ones (letters, digits, `-._~`)."""
    # no check to skip quote() for ids that need no escaping: it did not pay
    # (bench/reports/design-notes.md#configuration-serviceconfig)
    return quote(value, safe="")


class TemplateProblems(ValueError):
    """Everything wrong with a template, as (key, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{key}: {message}" for key, message in problems))
        self.problems = problems


def parse_format(template: str) -> list[tuple[str, str | None]]:
    """(literal text, placeholder or None) pairs of a str.format template; ValueError for
    a placeholder that is not a plain name, or an unmatched brace."""
    pieces: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if name is not None and (not name or spec or conversion):
            raise ValueError(f"placeholder {{{name}}} must be a plain name like {{tenant_id}}")
        pieces.append((literal, name))
    return pieces


def template_fields(template: str) -> set[str]:
    """The ``{name}`` placeholders of a str.format template (refuses positional ones)."""
    return {name for _, name in parse_format(template) if name is not None}


def unknown_placeholders(names: set[str], allowed: frozenset[str] | tuple[str, ...]
                         ) -> str | None:
    """What is wrong with placeholders outside `allowed`, or None when there are none."""
    unknown = names - set(allowed)
    if not unknown:
        return None
    return f"unknown placeholder(s) {sorted(unknown)}; allowed: {sorted(allowed)}"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def format_string(pieces: list[tuple[str, str | None]], constants: Mapping[str, str],
                  encode: Callable[[str], str]) -> str:
    """A str.format template of only the item's fields: literal text escaped, the policy's
    fields filled in (encoded) at once."""
    out = []
    for literal, name in pieces:
        out.append(_escape(literal))
        if name is None:
            continue
        if name in constants:
            out.append(_escape(encode(constants[name])))
        else:
            out.append("{" + name + "}")
    return "".join(out)
