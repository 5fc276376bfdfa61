"""An HTTP list source as the policies file writes it, and its request compiled.

    [policies.customer-erasure.source]
    upstream = "shopify"
    method = "POST"
    path = "/graphql.json"
    body = { query = "...", variables = { cursor = "{cursor}", q = "updated_at:<'{cutoff}'" } }
    tenants = ["shop-a.myshopify.com", "shop-b.myshopify.com"]
    items = "data.customers.nodes[*]"       # each entry of a page
    id = "legacyResourceId"                 # within an entry: the object id
    age = "updatedAt"                       # within an entry: when it became a candidate
    next = "data.customers.pageInfo.endCursor"
    more = "data.customers.pageInfo.hasNextPage"

The placeholders are `tenant_id` (the tenant walked), `cursor` (the previous page's next
cursor; none on the first page), `cutoff` (the run's cutoff less `older_than`, ISO 8601 UTC
to the second), `page` (the page size) and the policy's `policy` and `upstream`. They are
substituted as values, as in a deletion call's template (service/config/request_templates.py):
percent-encoded into one path segment or query value, JSON-encoded into a body, and a templated
host is checked against the upstream's host_pattern. On the first page a body's
`"{cursor}"` is null, and a query parameter whose value is exactly `{cursor}` is left out.

The JSON paths are those of answer rules (service/config/answer_rules.py): object keys, list
indices and
`[*]`. Everything is bounded: at most MAX_TENANTS tenants, MAX_PAGE entries a page,
MAX_PAGES_PER_PASS pages before the publisher moves on, and bodies of `max_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.config.answer_rules import MAX_BODY_BYTES, AnswerRule, parse_path
from service.config.body_templates import BodyPieces, BodyValue, body_value, compile_body, fill_body
from service.config.origins import Origin, checked_host
from service.config.placeholders import (
    PLACEHOLDER,
    TemplateProblems,
    format_string,
    parse_format,
    segment,
    unknown_placeholders,
)

LIST_FIELDS: Final = ("tenant_id", "cursor", "cutoff", "page", "policy", "upstream")
MAX_TENANTS: Final = 1000
MAX_PAGE: Final = 1000
MAX_PAGES_PER_PASS: Final = 10_000
MAX_CURSOR_CHARS: Final = 2048
# a tenant named in the file: a shop domain, a store hash, an account id
TenantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,252}$")]
JsonPath = Annotated[str, Field(min_length=1, max_length=500)]


class ListSourceConfig(BaseModel):
    """Where a policy's candidates come from when an upstream lists them: a list call per
    page, for each of `tenants` in turn, each page after the cursor the previous one named."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstream: str = Field(min_length=1, max_length=63)
    method: Literal["GET", "POST"] = "GET"
    path: str = Field(min_length=1, max_length=2000)
    body: dict[str, Any] | list[Any] | None = None
    tenants: list[TenantName] = Field(min_length=1, max_length=MAX_TENANTS)
    items: JsonPath
    id: JsonPath
    age: JsonPath
    next: JsonPath
    more: JsonPath | None = None
    page: int = Field(default=100, ge=1, le=MAX_PAGE)
    pages_per_pass: int = Field(default=100, ge=1, le=MAX_PAGES_PER_PASS)
    older_than: str = Field(default="PT0S", min_length=2, max_length=64)
    max_bytes: int = Field(default=MAX_BODY_BYTES, ge=1024, le=MAX_BODY_BYTES)
    answers: list[AnswerRule] = Field(default_factory=list, max_length=100)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        if "#" in value:
            raise ValueError("must not contain '#' (a fragment is never sent)")
        return value

    @field_validator("body", mode="before")
    @classmethod
    def _body(cls, value: Any) -> Any:
        return body_value(value)

    @field_validator("items")
    @classmethod
    def _each(cls, value: str) -> str:
        if not value.endswith("[*]"):
            raise ValueError("must end with [*]: each entry of the list a page holds, e.g. "
                             "'data.customers.nodes[*]'")
        return value

    @field_validator("items", "id", "age", "next", "more")
    @classmethod
    def _json_path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, value: list[str]) -> list[str]:
        twice = sorted({t for t in value if value.count(t) > 1})
        if twice:
            raise ValueError(f"{twice[0]!r} is listed twice")
        return value


def cutoff_text(cutoff: datetime) -> str:
    """`{cutoff}` as sent: ISO 8601 in UTC, to the second (truncated: never later)."""
    return cutoff.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ListRequest:
    """A list source's call, compiled: what varies per page is filled by `url` and `body`."""

    upstream: str
    method: str
    origin: Origin = field(repr=False)
    path_format: str  # the whole path (base path included)
    # (name=, value format, whether the value is exactly {cursor}: left out on the first page)
    query: tuple[tuple[str, str, bool], ...]
    host_format: str | None
    body_pieces: BodyPieces | None = field(repr=False)
    older_than: timedelta = timedelta(0)

    def cutoff(self, run_cutoff: datetime) -> datetime:
        """The cutoff the list call names: the run's, less the source's `older_than`, to
        the second (truncated: never later)."""
        return (run_cutoff - self.older_than).replace(microsecond=0)

    def host(self, tenant_id: str) -> str:
        """The host of the tenant's list calls; ValueError when the upstream refuses it."""
        if self.host_format is None:
            assert self.origin.host is not None
            return self.origin.host
        return checked_host(self.origin, self.host_format.format(tenant_id=tenant_id))

    def url(self, tenant_id: str, cursor: str | None, cutoff: datetime, page: int) -> str:
        """The page's URL, each value percent-encoded in its own segment or query value."""
        values = {"tenant_id": segment(tenant_id), "cursor": segment(cursor or ""),
                  "cutoff": segment(cutoff_text(cutoff)), "page": str(page)}
        pairs = [name + value.format(**values) for name, value, is_cursor in self.query
                 if cursor is not None or not is_cursor]
        return (self.origin.base(self.host(tenant_id)) + self.path_format.format(**values)
                + ("?" + "&".join(pairs) if pairs else ""))

    def body(self, tenant_id: str, cursor: str | None, cutoff: datetime, page: int
             ) -> bytes | None:
        if self.body_pieces is None:
            return None
        values: dict[str, BodyValue] = {"tenant_id": tenant_id, "cursor": cursor,
                                        "cutoff": cutoff_text(cutoff), "page": page}
        return fill_body(self.body_pieces, values)


def compile_list_request(origin: Origin, source: ListSourceConfig, *, policy: str,
                         older_than: timedelta) -> ListRequest:
    """The list call under its upstream's origin; TemplateProblems naming `path`, keys
    under `body`, or `tenants[i]` whose host the upstream refuses."""
    constants = {"policy": policy, "upstream": origin.upstream}
    route, _, query_text = source.path.partition("?")
    try:
        route_pieces = parse_format(route)
        query_pieces = [(pair, parse_format(pair)) for pair in query_text.split("&")
                        if pair] if query_text else []
    except ValueError as exc:
        raise TemplateProblems([("path", str(exc))]) from None
    names = {n for pieces in [route_pieces, *(p for _, p in query_pieces)] for _, n in pieces
             if n}
    problem = unknown_placeholders(names, LIST_FIELDS)
    problems = [("path", problem)] if problem else []
    query = _query(query_pieces, constants, problems)
    if source.method == "GET" and source.body is not None:
        problems.append(("body", "a GET list call sends no body: use method = \"POST\""))
    body_pieces = None
    if source.body is not None:
        try:
            body_pieces = compile_body(source.body, constants, allowed=LIST_FIELDS)
        except TemplateProblems as exc:
            problems.extend(exc.problems)
    problems += _origin_problems(origin)
    if problems:
        raise TemplateProblems(problems)
    request = ListRequest(
        upstream=origin.upstream, method=source.method, origin=origin,
        path_format=format_string(origin.path_pieces + route_pieces, constants, segment),
        query=query,
        host_format=None if origin.host_pieces is None else format_string(
            origin.host_pieces, constants, str.lower),
        body_pieces=body_pieces, older_than=older_than)
    problems = _tenant_problems(request, source.tenants)
    if problems:
        raise TemplateProblems(problems)
    return request


def _query(pairs: list[tuple[str, list[tuple[str, str | None]]]], constants: dict[str, str],
           problems: list[tuple[str, str]]) -> tuple[tuple[str, str, bool], ...]:
    """The query's (name=, value format, whether the value is exactly {cursor}) parameters;
    a parameter that is not name=value, or names a placeholder, goes to `problems`."""
    query = []
    for pair, _ in pairs:
        name, equals, value = pair.partition("=")
        if PLACEHOLDER.search(name) or not equals:
            problems.append(("path", f"query parameter {pair!r}: write name=value, a "
                                     "placeholder only in the value"))
            continue
        query.append((name + "=", format_string(parse_format(value), constants, segment),
                      value == "{cursor}"))
    return tuple(query)


def _origin_problems(origin: Origin) -> list[tuple[str, str]]:
    """Why the upstream's base_url cannot serve a list call: it fills only {tenant_id}."""
    problems = []
    host_names = {n for _, n in origin.host_pieces or [] if n}
    if host_names - {"tenant_id"}:
        problems.append(("upstream", f"a list call's host may hold only {{tenant_id}}; "
                                     f"upstream {origin.upstream!r} has "
                                     f"{sorted(host_names - {'tenant_id'})}"))
    path_names = {n for _, n in origin.path_pieces if n}
    if path_names - {"tenant_id", "policy", "upstream"}:
        problems.append(("upstream", f"upstream {origin.upstream!r}'s base path holds "
                                     f"{sorted(path_names)}: a list call fills only "
                                     "{tenant_id}"))
    return problems


def _tenant_problems(request: ListRequest, tenants: list[str]) -> list[tuple[str, str]]:
    """The tenants (by index) whose host the upstream refuses."""
    problems = []
    for i, tenant in enumerate(tenants):
        try:
            request.host(tenant)
        except ValueError as exc:
            problems.append((f"tenants[{i}]", str(exc)))
    return problems
