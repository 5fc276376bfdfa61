"""What can be told of a store statement from its text alone, before any database sees it.

A policy names SQL for the store's own database: the source query that finds candidates,
the target statement that deletes them, a guard's query. Their bind parameters are
SQLAlchemy's `:name` (what `sqlalchemy.text` binds, by the same pattern). What the text
cannot tell (the columns a query returns, whether its plan writes) is checked against the
store itself (service/sweeps/store_databases.py).
"""

from __future__ import annotations

import re
import uuid
from typing import Final

# sqlalchemy.sql.elements.TextClause._bind_params_regex: what `text()` binds
_BIND: Final = re.compile(r"(?<![:\w\x5c]):(\w+)(?!:)", re.UNICODE)
# literals, quoted identifiers and comments, which hold no keyword nor statement end
_OPAQUE: Final = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|/\*.*?\*/|(\$[A-Za-z_0-9]*\$).*?\1",
    re.DOTALL)
_WORD: Final = re.compile(r"[A-Za-z_]+")
MAX_SQL_CHARS: Final = 20_000


def binds(sql: str) -> set[str]:
    """The `:name` parameters `sqlalchemy.text(sql)` binds."""
    return set(_BIND.findall(sql))


def typed(sql: str, types: dict[str, str]) -> str:
    """`sql` with each `:name` of `types` bound as `CAST(:name AS type)`."""
    return _BIND.sub(lambda m: f"CAST(:{m.group(1)} AS {types[m.group(1)]})"
                     if m.group(1) in types else m.group(0), sql)


def _code(sql: str) -> str:
    """The text outside literals, quoted identifiers and comments (each left as a space)."""
    return _OPAQUE.sub(" ", sql)


def problems(sql: str, *, kinds: frozenset[str], required: frozenset[str],
             allowed: frozenset[str], returning: bool = False) -> list[str]:
    """Why `sql` cannot be this kind of statement: one statement whose first keyword is one
    of `kinds`, binding every parameter of `required` and none outside `allowed`, with a
    RETURNING clause when `returning`. Empty when it can."""
    found: list[str] = []
    code = _code(sql)
    words = _WORD.findall(code)
    first = words[0].lower() if words else ""
    if first not in kinds:
        found.append(f"must start with {' or '.join(sorted(k.upper() for k in kinds))}, "
                     f"not {first.upper() or 'nothing'}")
    if ";" in code.rstrip().rstrip(";"):
        found.append("must be one statement (no ';' inside)")
    named = binds(sql)
    missing = sorted(required - named)
    if missing:
        found.append(f"must use {', '.join(':' + m for m in missing)}")
    unknown = sorted(named - allowed)
    if unknown:
        found.append(f"unknown parameter(s) {', '.join(':' + u for u in unknown)}; allowed: "
                     f"{', '.join(':' + a for a in sorted(allowed))}")
    if returning and "returning" not in {w.lower() for w in words}:
        found.append("must end with RETURNING the object id of each row it deleted, e.g. "
                     "RETURNING id::text AS object_id")
    return found


def without_final_semicolon(sql: str) -> str:
    """The statement as it is embedded in another (a trailing ';' would end it early)."""
    return sql.rstrip().rstrip(";").rstrip()


# `CAST(:object_ids AS bigint[])` or `:object_ids::bigint[]`: the type a target's statement
# takes its ids as
_IDS_CAST: Final = re.compile(
    r"CAST\s*\(\s*:object_ids\s+AS\s+([a-z_][a-z0-9_ ]*?)\s*\[\s*\]\s*\)"
    r"|:object_ids\s*::\s*([a-z_][a-z0-9_ ]*?)\s*\[\s*\]", re.IGNORECASE)
_INTEGER_BITS: Final = {"smallint": 16, "int2": 16, "integer": 32, "int": 32, "int4": 32,
                        "bigint": 64, "int8": 64}
_INTEGER_TEXT: Final = re.compile(r"\s*[+-]?[0-9]{1,30}\s*", re.ASCII)


def ids_type(statement: str) -> str | None:
    """The type a target statement casts `:object_ids` to, element-wise (`bigint`), lower
    case with single spaces; None when it casts them to none the text names."""
    found = _IDS_CAST.search(_code(statement))
    if found is None:
        return None
    return " ".join((found[1] or found[2]).lower().split())


def id_type_problem(type_name: str | None, object_id: str) -> str | None:
    """Why `object_id` cannot be taken as `type_name` (an integer type or uuid; any other
    type, or None, takes every id here: the statement's own failure is the row's), without
    quoting it."""
    bits = _INTEGER_BITS.get(type_name or "")
    if bits is not None:
        if not _INTEGER_TEXT.fullmatch(object_id):
            return f"is not an integer, which the target's statement casts ids to ({type_name})"
        if not -(2 ** (bits - 1)) <= int(object_id) < 2 ** (bits - 1):
            return f"is out of the range of {type_name}, which the target's statement casts " \
                   "ids to"
    elif type_name == "uuid":
        text = object_id.strip()
        if text.lower().startswith("urn:"):
            return "is not a uuid, which the target's statement casts ids to"
        try:
            uuid.UUID(text)
        except ValueError:
            return "is not a uuid, which the target's statement casts ids to"
    return None
