"""The tests' import path for the fake upstream, which ships in the package
(`drills.upstream`) so that `sweeper drill` can start it on an operator's machine. Re-exports
its public names, keeps `python -m tests.fakes.upstream` working, and adds test-only helpers
built on its public API."""

from __future__ import annotations

import base64
import collections
import json
import sys
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, unquote

from drills.upstream import Call, FakeUpstream, Fault, main

__all__ = ["Call", "FakeUpstream", "Fault", "ListEndpoint", "Objects", "main", "over_limit"]


def over_limit(per_second: int) -> Callable[[Call], bool]:
    """A `match` for `FakeUpstream.inject`: true for a call once `per_second` calls of its
    scope were let through in the trailing second. Queued alone with a 429 status fault and
    `times=None`, it throttles with headers the test chooses (the fake's own limit always
    sends an integer Retry-After of at least 1). The fake calls it under its lock."""
    if per_second < 1:
        raise ValueError("per_second must be >= 1")
    passed: dict[str, collections.deque[float]] = {}

    def match(call: Call) -> bool:
        window = passed.setdefault(call.scope, collections.deque())
        while window and window[0] <= call.received_at - 1.0:
            window.popleft()
        if len(window) < per_second:
            window.append(call.received_at)
            return False
        return True

    return match


class Objects:
    """The objects under one path prefix of a FakeUpstream route (``route(prefix, objects)``):
    ``GET <prefix><id>`` answers 200 while the object is held, 404 once it is not;
    ``DELETE`` removes it (204; 404 when absent), unless `keep`: an upstream that answers
    204 and deletes nothing, so reads keep serving the object."""

    def __init__(self, prefix: str, ids: Iterable[str], *, keep: bool = False) -> None:
        self.prefix = prefix
        self.keep = keep
        self._lock = threading.Lock()
        self._held = set(ids)

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def __call__(self, call: Call) -> tuple[int, dict[str, str], bytes]:
        object_id = unquote(call.path[len(self.prefix):])
        with self._lock:
            there = object_id in self._held
            if call.method == "DELETE" and there and not self.keep:
                self._held.discard(object_id)
        if call.method == "DELETE":
            return (204 if there else 404), {}, b""
        if call.method == "GET" and there:
            return 200, {"Content-Type": "application/json"}, json.dumps(
                {"id": object_id}).encode()
        return (404 if call.method == "GET" else 405), {}, b""


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")


class ListEndpoint:
    """A paginated list of each tenant's objects, served by a FakeUpstream route, in two
    dialects, and the deletion of those objects:

    - REST: ``GET ...?updated_before=ISO&limit=N&cursor=C`` answers ``{"items": [{"id",
      "updated_at"}], "next_cursor": C | null}``;
    - Shopify-GraphQL-like: ``POST`` with ``{"query": ..., "variables": {"first": N,
      "cursor": C | null, "query": "updated_at:<'ISO'"}}`` answers ``{"data": {"customers":
      {"nodes": [{"legacyResourceId", "updatedAt"}], "pageInfo": {"hasNextPage",
      "endCursor"}}}}``;
    - ``DELETE .../<id>`` removes the object (204; 404 when absent), as does a ``POST`` of
      a ``customerDelete`` mutation (``variables.input.id``, a Shopify gid).

    Objects are listed in (updated_at, id) order, only those updated before the cutoff the
    call names; the cursor is opaque (the last object's key, base64). The tenant is the path
    segment `tenant_segment` (1 for ``/shops/<tenant>/...``); with `tokens`, a call must
    carry its tenant's token in `token_header`, else 401."""

    def __init__(self, *, tenant_segment: int = 2, tokens: dict[str, str] | None = None,
                 token_header: str = "x-shopify-access-token") -> None:  # noqa: S107
        self.tenant_segment = tenant_segment
        self.tokens = tokens
        self.token_header = token_header
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, dict[str, Any]]] = {}
        self.deleted: list[tuple[str, str]] = []

    def add(self, tenant: str, ids: Iterable[Any], updated_at: datetime) -> None:
        with self._lock:
            for object_id in ids:
                self._objects.setdefault(tenant, {})[str(object_id)] = {
                    "id": object_id, "updated_at": _iso(updated_at)}

    def add_raw(self, tenant: str, key: str, entry: dict[str, Any]) -> None:
        """An entry as written (a malformed id or age), listed by its `key`'s order."""
        with self._lock:
            self._objects.setdefault(tenant, {})[key] = entry

    def remaining(self, tenant: str) -> list[str]:
        with self._lock:
            return sorted(self._objects.get(tenant, {}))

    def __call__(self, call: Call) -> tuple[int, dict[str, str], bytes]:
        segments = [unquote(p) for p in call.path.split("/")]
        tenant = segments[self.tenant_segment] if len(segments) > self.tenant_segment else ""
        if self.tokens is not None and call.headers.get(self.token_header) != \
                self.tokens.get(tenant, object()):
            return _json(401, {"errors": "[API] Invalid API key or access token"})
        if call.method == "DELETE":
            with self._lock:
                found = self._objects.get(tenant, {}).pop(segments[-1], None)
                if found is not None:
                    self.deleted.append((tenant, segments[-1]))
            return (204, {}, b"") if found is not None else _json(404, {"errors": "Not Found"})
        if call.method == "POST" and json.loads(call.body)["query"].startswith("mutation"):
            gid = json.loads(call.body)["variables"]["input"]["id"]
            with self._lock:
                found = self._objects.get(tenant, {}).pop(gid.rsplit("/", 1)[-1], None)
                if found is not None:
                    self.deleted.append((tenant, gid.rsplit("/", 1)[-1]))
            return _json(200, {"data": {"customerDelete": {
                "deletedCustomerId": gid if found is not None else None,
                "userErrors": [] if found is not None else [
                    {"field": ["id"], "message": "Customer can't be found"}]}}})
        if call.method == "POST":
            variables = json.loads(call.body)["variables"]
            before = variables["query"].removeprefix("updated_at:<'").removesuffix("'")
            nodes, following = self._page(tenant, before, variables.get("cursor"),
                                          int(variables["first"]))
            return _json(200, {"data": {"customers": {
                "nodes": [{"legacyResourceId": e.get("id"), "updatedAt": e.get("updated_at")}
                          for e in nodes],
                "pageInfo": {"hasNextPage": following is not None,
                             "endCursor": following or (self._key(nodes[-1]) if nodes
                                                        else None)}}},
                "extensions": {"cost": {"actualQueryCost": 12}}})
        query = {k: v[0] for k, v in parse_qs(call.query).items()}
        items, following = self._page(tenant, query["updated_before"], query.get("cursor"),
                                       int(query.get("limit", "50")))
        return _json(200, {"items": items, "next_cursor": following})

    def _key(self, entry: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(
            [str(entry.get("updated_at")), str(entry.get("id"))]).encode()).decode()

    def _page(self, tenant: str, before: str, cursor: str | None, limit: int
              ) -> tuple[list[dict[str, Any]], str | None]:
        cutoff = datetime.fromisoformat(before)
        after = json.loads(base64.urlsafe_b64decode(cursor)) if cursor else None
        with self._lock:
            entries = sorted(self._objects.get(tenant, {}).values(),
                             key=lambda e: (str(e.get("updated_at")), str(e.get("id"))))
        due = [e for e in entries if not isinstance(e.get("updated_at"), str)
               or _before(e["updated_at"], cutoff)]
        if after is not None:
            due = [e for e in due if [str(e.get("updated_at")), str(e.get("id"))] > after]
        page = due[:limit]
        return page, self._key(page[-1]) if len(due) > limit else None


def _before(updated_at: str, cutoff: datetime) -> bool:
    try:
        return datetime.fromisoformat(updated_at) < cutoff
    except ValueError:
        return True  # a malformed age is listed: the client must refuse it


def _json(status: int, document: Any) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(document).encode()


if __name__ == "__main__":
    sys.exit(main())
