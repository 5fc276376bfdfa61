"""Request templates: a policy's upstream call (its URL, host included, and its JSON body),
compiled once at start-up from the policies file and filled per call with an item's fields.

    [upstreams.shopify]
    base_url = "https://{tenant_id}/admin/api/2025-01"
    host_pattern = '[a-z0-9][a-z0-9-]*\\.myshopify\\.com'
    [policies.customer-erasure]
    path = "/graphql.json"                  # or "/customers/{object_id}?version=2"
    body = { query = "...", variables = { id = "gid://shopify/Customer/{object_id}" } }

The fields are `tenant_id` and `object_id` (the item's) and `policy`, `policy_version` and
`upstream` (the policy's, filled in when the template is compiled); the path, query and
body may also use `object_version` (service/config/answer_rules.py: a conflict names the
next one). Each is substituted by where it goes, never by formatting text into text:

- host: as written, then checked whole (service/config/origins.py);
- path and query: percent-encoded, everything but the unreserved characters, so a value is
  exactly one path segment or one query value; `.` and `..` are refused
  (service/config/placeholders.py);
- body: as JSON values, never into a string that is code (service/config/body_templates.py).

Problems are `(key, message)` pairs, the key relative to the upstream or policy
(`base_url`, `host_pattern`, `path`, `body.variables.id`), listed all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service.config.body_templates import BodyPieces, Slot, compile_body, fill_body
from service.config.origins import Origin, checked_host
from service.config.placeholders import (
    DOT_SEGMENTS,
    ITEM_FIELDS,
    TemplateProblems,
    format_string,
    parse_format,
    segment,
)


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
    body_pieces: BodyPieces | None = field(repr=False)
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
    uses |= {p.name for p in body_pieces or () if isinstance(p, Slot)}
    # with a faulty body, what it would have sent is unknown: its own problems say enough
    problems += _object_problems(uses, batch=batch, body_failed=bool(problems))
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


def _object_problems(uses: set[str], *, batch: bool, body_failed: bool
                     ) -> list[tuple[str, str]]:
    """Whether a call names its objects as its policy sends them: one {object_id}, or a
    batch's {object_ids}."""
    problems = []
    if batch:
        if "object_ids" not in uses and not body_failed:
            problems.append(("path", "a policy with batch must send {object_ids} (in the "
                                     "path, query or body): the objects of the call"))
        for name in sorted(uses & {"object_id", "object_version"}):
            problems.append(("path", f"{{{name}}} names one object: a call of a batch "
                                     "carries many, as {object_ids}"))
    elif "object_ids" in uses:
        problems.append(("path", "{object_ids} is for a policy with batch = "
                                 "{ max_objects = N }: this one sends one object per call"))
    elif "object_id" not in uses and not body_failed:
        problems.append(("path", "must contain {object_id} (or the body, or the upstream's "
                                 "base_url, must): each item is its own call"))
    return problems
