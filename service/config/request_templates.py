"""Request templates: the URL (host included) and the JSON body of a policy's upstream call,
compiled once at start-up from the policies file and filled per call with an item's fields.

    [upstreams.shopify]
    base_url = "https://{tenant_id}/admin/api/2025-01"
    host_pattern = '[a-z0-9][a-z0-9-]*\\.myshopify\\.com'
    [policies.customer-erasure]
    path = "/graphql.json"                  # or "/customers/{object_id}?version=2"
    body = { query = "...", variables = { id = "gid://shopify/Customer/{object_id}" } }

The fields are `tenant_id` and `object_id` (the item's) and `policy`, `policy_version` and
`upstream` (the policy's, filled in when the template is compiled); the path, query and
body may also use `object_version` (service/config/answer_rules.py: a conflict names the next one).
Each is substituted by where it goes, never by formatting text into text:

- host: as written; the whole host must then be a host name (ASCII letters, digits and '-'
  in dot-separated labels, or an IPv4 address in dotted decimal: no hex, octal, integer or
  short forms) in its canonical form (lower case, no trailing dot: service/config/tenants.py spells
  tenant ids so at every entry) that the upstream's `host_pattern` fully matches; an IP
  literal or a single-label name (`localhost`, `metadata`) only where the upstream sets
  `allow_private_addresses`. So no value can add a port, a user, a path or another host:
  `/`, `?`, `#`, `@`, `:`, `%`, whitespace or unicode make no host name.
- path and query: percent-encoded, everything but the unreserved characters, so a value is
  exactly one path segment or one query value; `.` and `..` are refused.
- body: as JSON values. A string that is exactly one placeholder becomes the value itself (a
  JSON string; `policy_version` a number); placeholders among text are substituted inside
  that JSON string; keys are sent as written. A value full of quotes and braces stays a
  string: it is JSON-encoded, never spliced into JSON text. JSON escaping protects the JSON,
  not code inside a string, so no placeholder may go in a string that is code: under a key
  of CODE_KEYS (`query`, `mutation`, `sql`, ...; outside the top-level `variables`, which
  are data whatever their names) or reading as a GraphQL document; values go in data
  (GraphQL `variables`).

Problems are `(key, message)` pairs, the key relative to the upstream or policy
(`base_url`, `host_pattern`, `path`, `body.variables.id`), listed all at once.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time
from typing import Any, Final, NamedTuple
from urllib.parse import quote

from service.config.tenants import host_form
from service.protocols import strict_json

FIELDS: Final = ("tenant_id", "object_id", "policy", "policy_version", "upstream")
ITEM_FIELDS: Final = frozenset({"tenant_id", "object_id"})  # the rest are the policy's
# The path, query and body may also carry the object's version for an optimistic-concurrency
# API: the policy's initial_object_version, then the one a conflict answer named.
REQUEST_FIELDS: Final = (*FIELDS, "object_version", "object_ids")
# A policy that sends many objects per call names them all with {object_ids}: in a path or
# query the ids percent-encoded and joined with commas, in a body a JSON array of strings
# (inside a longer string, joined with commas).
DOT_SEGMENTS: Final = frozenset((".", ".."))

_UNRESERVED: Final = re.compile(r"[A-Za-z0-9_.~-]*", re.ASCII)  # what quote() keeps as is


def segment(value: str) -> str:
    """`value` percent-encoded as one path segment or query value."""
    # most ids need no escaping; quote() costs ten times the check
    return value if _UNRESERVED.fullmatch(value) else quote(value, safe="")


class TemplateProblems(ValueError):
    """Everything wrong with a template, as (key, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{key}: {message}" for key, message in problems))
        self.problems = problems


# -- str.format templates: base_url, path --------------------------------------------------


def parse_format(template: str) -> list[tuple[str, str | None]]:
    """(literal text, placeholder or None) pairs of a str.format template; ValueError for
    a placeholder that is not a plain name, or an unmatched brace."""
    pieces: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        if name is not None and (not name or spec or conversion):
            raise ValueError(f"placeholder {{{name}}} must be a plain name like {{tenant_id}}")
        pieces.append((literal, name))
    return pieces


def _unknown(names: set[str], allowed: frozenset[str] | tuple[str, ...]) -> str | None:
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


# -- hosts ---------------------------------------------------------------------------------

_LABEL: Final = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_NAME: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
_HOST_LITERAL: Final = re.compile(r"[A-Za-z0-9.-]*", re.ASCII)
MAX_HOST_CHARS: Final = 253
HOST_NAME_RULE: Final = ("ASCII letters, digits and '-' in dot-separated labels, "
                         "or an IPv4 address")


# A last label a resolver reads as a number (the WHATWG URL standard's "ends in a number";
# glibc's inet_aton likewise): all digits, or 0x and hex digits. Such a host is an address
# however it is spelled: `2130706433`, `0x7f000003`, `0177.0.0.1`, `127.1`, `0x7f.1`.
_NUMERIC_LABEL: Final = re.compile(r"[0-9]+|0x[0-9a-f]*", re.ASCII)


def host_name_problem(host: str) -> str | None:
    """Why `host` is no host name (compared lower-cased), or None. A last label that reads
    as a number makes the host an IPv4 address, which must then be in dotted decimal, four
    parts without leading zeros (`127.0.0.3`): the hex, octal, integer and short forms
    resolvers also take are refused. ASCII is checked before lower-casing: the Kelvin sign
    lower-cases to `k`."""
    if not host.isascii():
        return f"not a host name ({HOST_NAME_RULE})"
    host = host.lower()
    if len(host) > MAX_HOST_CHARS or not _HOST_NAME.fullmatch(host):
        return f"not a host name ({HOST_NAME_RULE})"
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "not a host name (a last label that reads as a number makes it an IPv4 " \
                   "address, and only dotted decimal is taken: no hex, octal, integer or " \
                   "short forms)"
    return None


def internal_host_problem(host: str) -> str | None:
    """Why `host` (a host name: `host_name_problem` passed it) may name an internal address
    by its form alone, or None: an IPv4 literal names the address itself, and a single-label
    name (`localhost`, `metadata`) resolves through the search domains to a host inside the
    network. Only an upstream with allow_private_addresses takes them."""
    if "." not in host:
        return "a single-label name (it resolves to hosts inside the network)"
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        return "an IP address"
    return None


# Values a hostile item could carry into a host: each must make a host the pattern refuses,
# or a pattern lets a value escape the host (`.*\.myshopify\.com` accepts
# `evil.example/x.myshopify.com`).
HOSTILE_HOST_VALUES: Final = tuple(
    [f"evil.example{c}x" for c in "/?#@:\\ %[]"] + [f"a{c}b" for c in "/?#@:\\ %"])
# Hosts no allow-list of a real upstream accepts: a pattern that matches one accepts any host
# (the last is the cloud metadata address).
ARBITRARY_HOSTS: Final = ("evil.example", "sweeper-probe.invalid", "169.254.169.254")
# Values that make internal hosts: single-label names and IP literals. A host_pattern that
# accepts one needs allow_private_addresses (a heuristic: every call checks its host).
INTERNAL_HOST_VALUES: Final = ("localhost", "metadata", "a", "kubernetes", "internal",
                               "127.0.0.1", "127.0.0.3", "10.0.0.1", "172.16.0.1",
                               "192.168.0.1", "169.254.169.254", "0.0.0.0", "1.2.3.4")  # noqa: S104 - probes


@dataclass(frozen=True)
class Origin:
    """An upstream's base_url, compiled: `prefix` (scheme and user info), the host (fixed, or
    a template guarded by `pattern`), `port` (":8443" or "") and the base path's pieces."""

    upstream: str
    prefix: str
    host: str | None  # the fixed host; None when templated
    host_pieces: list[tuple[str, str | None]] | None
    pattern: re.Pattern[str] | None
    port: str
    path_pieces: list[tuple[str, str | None]]
    # a templated host may be an IP literal or a single-label name (tests, in-cluster)
    allow_private: bool = False

    @property
    def tenant_in_host(self) -> bool:
        """Whether the host is built from the tenant id (which then has one spelling:
        service/config/tenants.py)."""
        return any(name == "tenant_id" for _, name in self.host_pieces or ())

    def base(self, host: str) -> str:
        """scheme://[userinfo@]host[:port], for a client's URL maker."""
        return f"{self.prefix}{host}{self.port}"


_BASE_URL: Final = re.compile(r"(?P<scheme>https?)://(?P<authority>[^/]*)(?P<path>/.*)?",
                              re.DOTALL)


def compile_origin(upstream: str, base_url: str, host_pattern: str | None, *,
                   allow_private: bool = False) -> Origin:
    """Compile a base_url (already checked against the schema's pattern, trailing '/'
    stripped); TemplateProblems naming `base_url` or `host_pattern`. Without
    `allow_private`, a templated host can be no IP literal nor single-label name, and a
    pattern that admits one is refused."""
    problems: list[tuple[str, str]] = []
    match = _BASE_URL.fullmatch(base_url)
    if match is None:  # the schema's pattern refused it already
        raise TemplateProblems([("base_url", "must be http(s)://host[:port][/path]")])
    authority, path = match["authority"], match["path"] or ""
    userinfo, at, hostport = authority.rpartition("@")
    if hostport.startswith("["):
        host, _, port = hostport.partition("]")
        host += "]"
    else:
        host, colon, port = hostport.partition(":")
        port = colon + port
    try:
        pieces = {part: parse_format(text) for part, text in (
            ("user info", userinfo), ("host", host), ("port", port), ("path", path))}
    except ValueError as exc:
        raise TemplateProblems([("base_url", str(exc))]) from None
    names = {part: {n for _, n in p if n is not None} for part, p in pieces.items()}
    problem = _unknown(set().union(*names.values()), FIELDS)
    if problem:
        problems.append(("base_url", problem))
    for part in ("user info", "port"):
        if names[part]:
            problems.append(("base_url", f"a placeholder cannot be in the {part}; only in "
                                         "the host and the path"))
    if port and not names["port"] and not re.fullmatch(r":[0-9]{1,5}", port):
        problems.append(("base_url", "the port must be a number"))
    templated = bool(names["host"])
    if templated:
        literals = [literal for literal, _ in pieces["host"]]
        if not all(_HOST_LITERAL.fullmatch(text) for text in literals):
            problems.append(("base_url", "in a host with a placeholder, the text around it "
                                         "may only be letters, digits, '-' and '.'"))
    if templated and host_pattern is None:
        problems.append(("host_pattern", "required when the base_url's host has a "
                                         "placeholder: the hosts an item may make, e.g. "
                                         "'[a-z0-9][a-z0-9-]*\\.myshopify\\.com'"))
    if not templated and host_pattern is not None:
        problems.append(("host_pattern", "only for a base_url whose host has a placeholder"))
    pattern = None
    if templated and host_pattern is not None:
        try:
            pattern = re.compile(host_pattern)
        except re.error as exc:
            problems.append(("host_pattern", f"not a regular expression: {exc}"))
        else:
            problems.extend(("host_pattern", p) for p in _pattern_problems(
                pattern, pieces["host"], allow_private=allow_private))
    if problems:
        raise TemplateProblems(problems)
    prefix = f"{match['scheme']}://" + (userinfo + at if at else "")
    return Origin(upstream=upstream, prefix=prefix, host=None if templated else host,
                  host_pieces=pieces["host"] if templated else None, pattern=pattern,
                  port=port, path_pieces=pieces["path"], allow_private=allow_private)


# A run of literal host characters at the start or end of a pattern (`\\.myshopify\\.com`)
_LITERAL_RUN: Final = r"(?:\\[.-]|[A-Za-z0-9-])+"
_LEADING: Final = re.compile(rf"\^?({_LITERAL_RUN})")
_TRAILING: Final = re.compile(rf"({_LITERAL_RUN})\$?\Z")


def _affixes(pattern: str) -> tuple[str, str]:
    """The literal text a pattern starts and ends with, if any (`.*\\.myshopify\\.com` ends
    with `.myshopify.com`): hostile probes wear them, or a whole-host template would never
    meet the pattern with one."""
    lead, tail = _LEADING.match(pattern), _TRAILING.search(pattern)

    def literal(found: re.Match[str] | None) -> str:
        return "" if found is None else re.sub(r"\\(.)", r"\1", found[1])
    return literal(lead), literal(tail)


def _internal_values(prefix: str, suffix: str) -> list[str]:
    """INTERNAL_HOST_VALUES, also wearing the pattern's literal affixes, and completed to
    IPv4 literals where an affix is one in part (`127\\.0\\.0\\.[0-9]+` starts with
    `127.0.0.`)."""
    values = [*INTERNAL_HOST_VALUES]
    if prefix or suffix:
        values += [prefix + value + suffix for value in INTERNAL_HOST_VALUES]
    for parts in range(1, 5):
        numbers = ".".join(["1"] * parts)
        values += [prefix + numbers, numbers + suffix, prefix + numbers + suffix]
    return values


def _pattern_problems(pattern: re.Pattern[str], host: list[tuple[str, str | None]], *,
                      allow_private: bool = False) -> list[str]:
    """Why `pattern` could let a value escape the host template, accept any host, or
    (without `allow_private`) make an internal one. (A heuristic, probing with hostile
    values: the host itself is checked on every call.)"""
    prefix, suffix = _affixes(pattern.pattern)

    def made_of(value: str) -> str:
        return "".join(literal + (value if name else "") for literal, name in host).lower()
    values = [*HOSTILE_HOST_VALUES,
              *(prefix + value + suffix for value in HOSTILE_HOST_VALUES if prefix or suffix)]
    for value in values:
        made = made_of(value)
        if pattern.fullmatch(made):
            return [f"accepts {made!r}, which is no host name (an item's id would carry the "
                    "call out of the host): allow only letters, digits, '-' and '.' where a "
                    "placeholder goes, e.g. '[a-z0-9-]+'"]
    accepted = [host for host in ARBITRARY_HOSTS if pattern.fullmatch(host)]
    if accepted:
        return [f"accepts any host (e.g. {accepted[0]!r}): anchor it to the upstream's own "
                f"domain, e.g. '[a-z0-9][a-z0-9-]*\\.myshopify\\.com'"]
    if allow_private:
        return []
    for value in _internal_values(prefix, suffix):
        made = made_of(value)
        if host_name_problem(made) is None and pattern.fullmatch(made):
            what = internal_host_problem(made)
            if what is not None:
                return [f"accepts {made!r}, {what}: anchor it to the upstream's own domain, "
                        "e.g. '[a-z0-9][a-z0-9-]*\\.myshopify\\.com', or set "
                        "allow_private_addresses = true on the upstream (for tests and "
                        "in-cluster services)"]
    return []


# -- JSON bodies ---------------------------------------------------------------------------

_PLACEHOLDER: Final = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Slot(NamedTuple):
    """Where an item's field goes in the body: the whole JSON value, or inside a string."""

    name: str
    whole: bool


def _key_path(at: str, key: str) -> str:
    return f"{at}.{key}" if re.fullmatch(r"[A-Za-z0-9_-]+", key) else f"{at}.{json.dumps(key)}"


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
    elif _GRAPHQL.match(_PLACEHOLDER.sub("", text)):
        meaning = "this string reads as a GraphQL document, which is code"
    else:
        return None
    return (f"{meaning}: a placeholder in it would splice an id into the code (JSON escaping "
            f"keeps the body JSON, not the code inside it); {SAFE_FORM}")


def compile_body(template: Any, constants: Mapping[str, str | int],
                 allowed: Sequence[str] = REQUEST_FIELDS) -> tuple[str | _Slot, ...]:
    """The body template as JSON text with slots for the item's fields (the policy's are
    filled in now); TemplateProblems naming each faulty key under `body`. `allowed` are the
    placeholders it may hold (a list source's differ: service/config/list_sources.py). No
    placeholder may go where a string is code (`code_problem`)."""
    out: list[str | _Slot] = []
    problems: list[tuple[str, str]] = []

    def literal_string(text: str) -> str:
        return json.dumps(text)[1:-1]

    def walk(value: Any, at: str, key: str | None = None) -> None:
        if isinstance(value, dict):
            out.append("{")
            for n, (name, item) in enumerate(value.items()):
                if _PLACEHOLDER.search(name):
                    problems.append((_key_path(at, name), "a key is sent as written, never "
                                                         "filled in: put the placeholder in "
                                                         "a value"))
                out.append(("," if n else "") + json.dumps(name) + ":")
                walk(item, _key_path(at, name), name)
            out.append("}")
        elif isinstance(value, list):
            out.append("[")
            for n, item in enumerate(value):
                if n:
                    out.append(",")
                walk(item, f"{at}[{n}]", key)
            out.append("]")
        elif isinstance(value, str):
            string_template(value, at, None if in_variables(at) else key)
        elif isinstance(value, (bool, int)) or value is None:
            out.append(json.dumps(value))
        elif isinstance(value, float):
            if not math.isfinite(value):
                problems.append((at, f"{value} has no JSON form"))
            out.append(json.dumps(value))
        elif isinstance(value, (datetime, date, time)):
            problems.append((at, "a TOML date or time has no JSON form: write it as a "
                                 "string"))
        else:
            problems.append((at, f"a {type(value).__name__} has no JSON form"))

    def in_variables(at: str) -> bool:
        # GraphQL variables are data whatever their names (a `query` variable included)
        return at.startswith("body.variables.") or at.startswith("body.variables[")

    def string_template(text: str, at: str, key: str | None) -> None:
        names = _PLACEHOLDER.findall(text)
        problem = _unknown(set(names), tuple(allowed))
        if problem:
            problems.append((at, problem + " (a placeholder is {name}; any other brace is "
                                           "text, e.g. a GraphQL selection '{ id }')"))
            return
        problem = code_problem(key, text) if names else None
        if problem:
            problems.append((at, problem))
            return
        whole = _PLACEHOLDER.fullmatch(text)
        if whole:
            name = whole[1]
            out.append(json.dumps(constants[name]) if name in constants
                       else _Slot(name, whole=True))
            return
        out.append('"')
        at_char = 0
        for found in _PLACEHOLDER.finditer(text):
            out.append(literal_string(text[at_char:found.start()]))
            name = found[1]
            out.append(literal_string(str(constants[name])) if name in constants
                       else _Slot(name, whole=False))
            at_char = found.end()
        out.append(literal_string(text[at_char:]) + '"')

    try:
        walk(template, "body")
    except RecursionError:
        problems.append(("body", "nested too deeply"))
    if problems:
        raise TemplateProblems(problems)
    merged: list[str | _Slot] = []
    for piece in out:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return tuple(merged)


# -- a policy's request --------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTemplate:
    """A policy's upstream call, compiled: what varies per item is filled by `target`,
    `host` and `body`, everything else was filled in when it was compiled."""

    upstream: str
    origin: Origin = field(repr=False)
    path_format: str  # the whole path (base path included); only item fields remain
    query_format: str | None
    host_format: str | None  # None: the upstream's host is fixed
    host_uses: frozenset[str]  # the item's fields the host is made of
    body_pieces: tuple[str | _Slot, ...] | None = field(repr=False)
    uses_object_version: bool = False

    @property
    def host_field(self) -> str:
        """The item field a refused host is reported on."""
        return "tenant_id" if "tenant_id" in self.host_uses or not self.host_uses \
            else "object_id"

    def target(self, tenant_id: str, object_id: str, object_version: str = "",
               object_ids: Sequence[str] = ()) -> tuple[str, str | None]:
        """The path and query (None: none), each value percent-encoded in its own segment
        or query value (`object_ids` each, joined with commas); ValueError for a dot
        segment."""
        if object_id in DOT_SEGMENTS or tenant_id in DOT_SEGMENTS or (
                object_version in DOT_SEGMENTS) or any(i in DOT_SEGMENTS for i in object_ids):
            raise ValueError("dot segments cannot be an id")
        values = {"object_id": segment(object_id), "tenant_id": segment(tenant_id),
                  "object_version": segment(object_version),
                  "object_ids": ",".join(segment(i) for i in object_ids)}
        path = self.path_format.format(**values)
        if self.query_format is None:
            return path, None
        return path, self.query_format.format(**values)

    def host(self, tenant_id: str, object_id: str) -> str:
        """The host of a templated upstream for this item (lower-cased); ValueError saying
        why the item cannot have it (without the value: answers never echo input)."""
        assert self.host_format is not None
        return checked_host(self.origin, self.host_format.format(tenant_id=tenant_id,
                                                                 object_id=object_id))

    def host_problem(self, tenant_id: str, object_id: str) -> str | None:
        """Why this item's host would be refused, or None (always None for a fixed host)."""
        if self.host_format is None:
            return None
        try:
            self.host(tenant_id, object_id)
        except ValueError as exc:
            return str(exc)
        return None

    def body(self, tenant_id: str, object_id: str, object_version: str = "",
             object_ids: Sequence[str] = ()) -> bytes | None:
        """The JSON body for this item, or these items (None: the policy sends none)."""
        if self.body_pieces is None:
            return None
        return fill_body(self.body_pieces, {
            "tenant_id": tenant_id, "object_id": object_id, "object_version": object_version,
            "object_ids": list(object_ids)})


BodyValue = str | int | list[str] | None


def fill_body(pieces: Sequence[str | _Slot], values: Mapping[str, BodyValue]) -> bytes:
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


def checked_host(origin: Origin, made: str) -> str:
    """A templated host as filled in, or ValueError saying why it is refused (without the
    value, but for its canonical form: answers never echo input): no host name, not in its
    canonical form (service/config/tenants.py), an IP literal or single-label name the upstream
    does not allow (allow_private_addresses), or not one its host_pattern allows."""
    assert origin.pattern is not None
    problem = host_name_problem(made)
    if problem:
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is "
                         f"{problem}")
    canonical = host_form(made)
    if made != canonical:
        # a second spelling of a host is a second identity of its tenant (service/config/tenants.py)
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is not in "
                         f"its canonical form {canonical!r} (lower case, no trailing dot)")
    internal = None if origin.allow_private else internal_host_problem(made)
    if internal is not None:
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is "
                         f"{internal}, which it does not allow (allow_private_addresses)")
    if not origin.pattern.fullmatch(made):
        raise ValueError(f"would make a host that upstream {origin.upstream!r} does not "
                         "allow (its host_pattern)")
    return made


def compile_request(origin: Origin, *, policy: str, version: int, path: str,
                    body: Any = None, batch: bool = False) -> RequestTemplate:
    """A policy's request under its upstream's origin (`batch`: many objects per call);
    TemplateProblems naming `path` or keys under `body`."""
    constants: dict[str, str | int] = {"policy": policy, "policy_version": version,
                                       "upstream": origin.upstream}
    text = {name: str(value) for name, value in constants.items()}
    problems: list[tuple[str, str]] = []
    route, _, query = path.partition("?")
    path_pieces = parse_format(route)  # the schema validated the placeholders
    query_pieces = parse_format(query) if "?" in path else None
    body_pieces = None
    if body is not None:
        try:
            body_pieces = compile_body(body, constants)
        except TemplateProblems as exc:
            problems.extend(exc.problems)
    uses = {name for pieces in (origin.host_pieces or [], origin.path_pieces, path_pieces,
                                query_pieces or []) for _, name in pieces if name}
    uses |= {p.name for p in body_pieces or () if isinstance(p, _Slot)}
    if batch:
        if "object_ids" not in uses and not (body is not None and problems):
            problems.append(("path", "a policy with batch must send {object_ids} (in the "
                                     "path, query or body): the objects of the call"))
        for name in sorted(uses & {"object_id", "object_version"}):
            problems.append(("path", f"{{{name}}} names one object: a call of a batch "
                                     "carries many, as {object_ids}"))
    elif "object_ids" in uses:
        problems.append(("path", "{object_ids} is for a policy with batch = "
                                 "{ max_objects = N }: this one sends one object per call"))
    elif "object_id" not in uses and not (body is not None and problems):
        problems.append(("path", "must contain {object_id} (or the body, or the upstream's "
                                 "base_url, must): each item is its own call"))
    if problems:
        raise TemplateProblems(problems)
    host_format = None
    if origin.host_pieces is not None:
        host_format = format_string(origin.host_pieces, text, str.lower)
    return RequestTemplate(
        upstream=origin.upstream, origin=origin,
        path_format=format_string(origin.path_pieces + path_pieces, text, segment),
        query_format=None if query_pieces is None else format_string(query_pieces, text,
                                                                      segment),
        host_format=host_format,
        host_uses=frozenset(name for _, name in origin.host_pieces or [] if name) & ITEM_FIELDS,
        body_pieces=body_pieces, uses_object_version="object_version" in uses)
