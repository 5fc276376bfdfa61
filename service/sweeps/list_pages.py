"""An HTTP list source's pages: one list call per page, under the scope's budget, its answer
read into candidates, problems and the next cursor (service/runs/discovery.py applies each page).

Each call takes a token from the tenant's scope (the policy's scope of that tenant: the same
bucket its deletions draw from), sends the source's compiled request
(service/config/list_sources.py) through the upstream's client with the tenant's credential, and is
classified as any upstream answer is (service/outcomes.py, with the source's own answer rules
first). What an answer does to the scope is what it does for a deletion
(service/budget/answer_effects.py):

    answer                          discovery                       the scope
    2xx                             the page is read                -
    429 (503 with a date)           waits: SourceDeferred           closed until Retry-After
    5xx, connect error, timeout     waits: SourceDeferred           -
    401/403, no credential          the tenant is skipped this run  paused with the reason
    other 4xx                       the tenant is skipped this run  -
    the scope closed (or workers    waits: SourceDeferred           -
    paused) before the call
    the scope paused before it      the tenant is skipped this run  -

"Waits" leaves the run publishing with the reason on its discovery row; the publisher's
next pass resumes from the persisted cursor. A tenant skipped is recorded as a discovery
error naming why; the run goes on with the next tenant, and a later run walks it again.

A page's entries that cannot become items (a missing or malformed id or age, an age not
before the cutoff the call named) are discovery errors; the rest of the page is kept. A page
with no list where `items` points (a GraphQL error inside a 200) is an error that ends the
tenant's walk, never an empty page. The
walk of a tenant ends when the next cursor is absent, null or empty, or `more` is false; a
next cursor that is no short string (or repeats the current one) is an error that ends it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.budget import buckets
from service.budget.answer_effects import effects_of
from service.budget.credential_waits import Credentials
from service.budget.rules import LOOKAHEAD_S, budget_of
from service.config.answer_rules import NOT_JSON, parse_path, read_json, values_at
from service.config.list_sources import MAX_CURSOR_CHARS, cutoff_text
from service.config.policies import Policies, Policy
from service.db.statements import CLOSURE_OVER, Statement, fetch
from service.observability.metrics import SCOPE_SIGNALS
from service.outcomes import Answer, Classified, Outcome, classify
from service.upstreams.deletion_api import UpstreamClient, Upstreams

log = logging.getLogger(__name__)

SHOWN_CHARS: Final = 64  # of a malformed value, only this much is kept (repr'd)
# the longest a list call waits for its token within a pass; a longer wait is left for a
# later pass (the publisher has other runs to publish)
MAX_TOKEN_WAIT_S: Final = 5.0


class SourceDeferred(Exception):
    """A list source cannot go on now: the run stays publishing, the reason on its
    discovery row, and the publisher's next pass resumes from the persisted cursor.
    `quiet` when nothing is wrong (the pass read its pages, the workers are paused)."""

    def __init__(self, policy: str, reason: str, *, quiet: bool = False) -> None:
        super().__init__(reason)
        self.policy = policy
        self.reason = reason
        self.quiet = quiet


@dataclass(frozen=True)
class Entry:
    """A page's entry as discovery sorts a row (service/runs/discovery.py `sort_page`)."""

    tenant_id: str
    object_id: str
    age: datetime


@dataclass(frozen=True)
class Listed:
    """One step of a tenant's walk: the entries that may become items, the problems of
    those that cannot (and why a tenant was skipped), and the next cursor (None: the
    tenant's walk ends). `read` is 1 when an upstream's page was read, 0 for a skip."""

    entries: list[Entry]
    errors: list[dict[str, str]] = field(default_factory=list)
    next: str | None = None
    read: int = 1


def shown(value: object) -> str:
    return repr(value)[:SHOWN_CHARS]


def _skipped(tenant: str, problem: str) -> Listed:
    return Listed([], [{"tenant_id": shown(tenant), "object_id": "", "problem": problem}],
                  None, read=0)


def _object_id(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _age(value: Any) -> datetime | None:
    """An ISO 8601 time with its offset, or Unix seconds; None for anything else."""
    if isinstance(value, str) and len(value) <= 64:
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            return None
        return when if when.tzinfo is not None else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            math.isfinite(value) and 0 <= value < 253402300800:  # before the year 10000
        return datetime.fromtimestamp(value, UTC)
    return None


def _first(document: Any, path: str) -> Any:
    found = values_at(document, parse_path(path))
    return found[0] if found else None


def read_page(policy: Policy, tenant: str, cursor: str | None, document: Any,
              cutoff: datetime) -> Listed:
    """A page's JSON document read by the source's paths: entries, problems, next cursor.
    `cutoff` is the one the call named: an entry not older is refused (the endpoint did not
    filter by it), never deleted."""
    source = policy.list_source
    assert source is not None
    entries: list[Entry] = []
    errors: list[dict[str, str]] = []
    steps = parse_path(source.items)
    if not any(isinstance(found, list) for found in values_at(document, steps[:-1])):
        # no list where the entries go (a GraphQL error in a 200, a query that changed):
        # never read as an empty page, which would end the walk silently
        return Listed([], [{"tenant_id": shown(tenant), "object_id": "", "problem": (
            f"the page holds no list at {source.items.removesuffix('[*]')!r}: this "
            "tenant's walk ends here")}], None)
    for entry in values_at(document, steps):
        raw_id, raw_age = _first(entry, source.id), _first(entry, source.age)
        object_id, age = _object_id(raw_id), _age(raw_age)
        problem = None
        if object_id is None:
            problem = "object_id is missing" if raw_id is None else \
                "object_id is not a string or an integer"
        elif age is None:
            problem = "age is missing" if raw_age is None else \
                "age is not an ISO 8601 time with an offset, nor Unix seconds"
        elif age >= cutoff:
            problem = f"age is not before the cutoff {cutoff_text(cutoff)} the list call named"
        if problem is not None:
            errors.append({"tenant_id": shown(tenant), "object_id": shown(raw_id),
                           "problem": problem})
            continue
        assert object_id is not None
        assert age is not None
        entries.append(Entry(tenant, object_id, age))
    more = _first(document, source.more) if source.more is not None else None
    raw_next = _first(document, source.next)
    following = _object_id(raw_next)
    if more is False or raw_next is None or raw_next == "":
        following = None  # the last page
    elif following is None or len(following) > MAX_CURSOR_CHARS or \
            not following.isprintable():
        errors.append({"tenant_id": shown(tenant), "object_id": "", "problem": (
            f"the next cursor is no string of at most {MAX_CURSOR_CHARS} printable "
            "characters: this tenant's walk ends here")})
        following = None
    elif following == cursor:
        errors.append({"tenant_id": shown(tenant), "object_id": "", "problem": (
            "the next cursor repeats this page's: this tenant's walk ends here")})
        following = None
    return Listed(entries, errors, following)


# One token of a scope's bucket for one list call: the buckets' grant (closed and paused
# scopes, and every scope during a workers-wide pause, grant nothing), charged at once.
_TAKE = Statement("list_pages.take_token", (
    "Take one token of a scope's bucket for a list call (none from a closed or paused "
    "scope), reserving it up to the lookahead."), f"""
    WITH {buckets.GRANTS_SQL}
    UPDATE scopes s SET tokens = g.avail - g.n, refilled_at = g.at
    FROM grants g WHERE s.name = g.scope
    RETURNING g.n AS granted, g.avail, g.rate
""")  # noqa: S608 - only constant fragments are interpolated
_WHY_NOT = Statement("list_pages.scope_state", (
    "Why a scope granted no token: closed (until when, why), paused (why), or the workers "
    "paused."), f"""
    SELECT s.paused, s.paused_reason, s.closed_reason, NOT {CLOSURE_OVER} AS closed,
           s.closed_until, (SELECT workers_paused FROM control) AS workers_paused
    FROM scopes s WHERE s.name = :scope
""")  # noqa: S608 - only a constant fragment is interpolated


class Lister:
    """The list calls of one publisher pass: the upstreams' clients (closed by `aclose`)
    and the tenants' credentials."""

    def __init__(self, policies: Policies, credentials: Credentials | None) -> None:
        self.policies = policies
        self.credentials = credentials or Credentials({})
        self._upstreams: Upstreams | None = None
        self._ensured: set[str] = set()

    def _client(self, policy: Policy) -> UpstreamClient:
        assert policy.listing is not None
        if self._upstreams is None:
            listed = {p.listing.upstream for p in self.policies.policies.values()
                      if p.listing is not None}
            self._upstreams = Upstreams({name: up for name, up in
                                         self.policies.upstreams.items() if name in listed})
        return self._upstreams.client(policy.listing.upstream)

    async def aclose(self) -> None:
        if self._upstreams is not None:
            await self._upstreams.aclose()
            self._upstreams = None

    def tenants(self, policy: Policy, run: Mapping[str, Any]) -> list[str]:
        """The tenants a run walks, in order: the source's, or the run's one of them."""
        source = policy.list_source
        assert source is not None
        return sorted(t for t in source.tenants if run["tenant_id"] in (None, t))

    async def page(self, engine: AsyncEngine, run: Mapping[str, Any], policy: Policy,
                   tenant: str, cursor: str | None) -> Listed:
        """One step of `tenant`'s walk after `cursor`: a page read, or the tenant skipped.
        SourceDeferred when the walk must wait."""
        source, listing = policy.list_source, policy.listing
        assert source is not None
        assert listing is not None
        scope = policy.scope_for(tenant)
        skip = await self._token(engine, policy, scope)
        if skip is not None:
            return _skipped(tenant, skip)
        credential = await self._credential(policy, tenant)
        cutoff = listing.cutoff(run["cutoff"])
        try:
            url = listing.url(tenant, cursor, cutoff, source.page)
            body = listing.body(tenant, cursor, cutoff, source.page)
        except ValueError as exc:  # the file's check lets none through; never a crash
            return _skipped(tenant, f"the list call cannot be made: {exc}")
        rules = policy.list_answers
        answer = await self._client(policy).read_page(
            listing.method, url, body, credential=credential,
            wants_body=lambda status: 200 <= status < 300 or rules.wants_body(status),
            cap=source.max_bytes)
        now = datetime.now(UTC)
        verdict = classify(answer, absent_means_deleted=False, now=now,
                           ruled=_ruled(policy, answer))
        paused = await self._signal(engine, policy, scope, verdict, answer, now)
        return _step(policy, tenant, cursor, cutoff, scope, verdict, answer, paused)

    async def _credential(self, policy: Policy, tenant: str) -> str | None:
        """The tenant's credential for the list calls' upstream (None: it takes none).
        SourceDeferred when it cannot be read."""
        assert policy.listing is not None
        upstream = self.policies.upstreams[policy.listing.upstream]
        if not upstream.per_tenant_credentials:
            return None
        try:
            return await self.credentials.get(tenant, upstream.name)
        except Exception:
            raise SourceDeferred(policy.name, f"tenant {tenant!r}: its credential could "
                                              "not be read") from None

    async def _token(self, engine: AsyncEngine, policy: Policy, scope: str) -> str | None:
        """Wait for one token of `scope` (within MAX_TOKEN_WAIT_S): None once held, or why
        the tenant is skipped (its scope paused). SourceDeferred while it is closed, the
        workers are paused, or the token is further off."""
        if scope not in self._ensured:
            async with engine.begin() as conn:
                await buckets.ensure_scopes(conn, {scope: budget_of(policy)})
            self._ensured.add(scope)
        rows = await fetch(engine, _TAKE, {"names": [scope], "wants": [1],
                                           "lookahead": LOOKAHEAD_S})
        if rows and rows[0].granted:
            # the token is due once the bucket reaches it (at once unless it was lent ahead)
            await asyncio.sleep(max(0.0, (1.0 - float(rows[0].avail)) / float(rows[0].rate)))
            return None
        if rows:
            wait = (1.0 - float(rows[0].avail)) / float(rows[0].rate)
            if wait > MAX_TOKEN_WAIT_S:
                raise SourceDeferred(policy.name, f"scope {scope!r}: the next token is "
                                                  f"{wait:.1f} s away", quiet=True)
            await asyncio.sleep(wait)
            return await self._token(engine, policy, scope)
        [state] = await fetch(engine, _WHY_NOT, {"scope": scope})
        if state.workers_paused:
            raise SourceDeferred(policy.name, "the workers are paused: discovery waits",
                                 quiet=True)
        if state.paused:
            return (f"scope {scope!r} is paused ({state.paused_reason or 'by an operator'}); "
                    "this tenant is not walked in this run")
        if not state.closed:  # it reopened since
            return await self._token(engine, policy, scope)
        # quiet: the answer that closed it was the warning
        raise SourceDeferred(policy.name, f"scope {scope!r} is closed until "
                                          f"{state.closed_until.isoformat()} "
                                          f"({state.closed_reason or 'throttled'})",
                             quiet=True)

    async def _signal(self, engine: AsyncEngine, policy: Policy, scope: str,
                      verdict: Classified, answer: Answer, now: datetime) -> str | None:
        """What the answer does to the scope, for every replica at once (as a worker's
        urgent signals); the pause's reason, if it paused the scope."""
        effects = effects_of(verdict, answer, policy.config, now)
        for signal in effects.signals:
            SCOPE_SIGNALS.labels(signal).inc()
        if effects.closure is not None:
            await buckets.close(engine, {scope: effects.closure})
        elif effects.refund or effects.cap is not None:
            await buckets.adjust(engine, {scope: effects.refund} if effects.refund else {},
                                 {scope: effects.cap} if effects.cap is not None else {})
        if effects.pause is not None:
            for paused in await buckets.pause(engine, [scope], effects.pause):
                log.warning("scope paused: a list call was refused",
                            extra={"scope": paused, "policy": policy.name,
                                   "reason": effects.pause, "outcome": verdict.reason})
        return effects.pause


def _ruled(policy: Policy, answer: Answer) -> Classified | None:
    """What the source's own answer rules make of the answer, if they read it. An answer
    the rules cannot read is read by its status alone (as the worker reads one): a hostile
    body never stops discovery."""
    rules = policy.list_answers
    if answer.status is None or rules.reads_nothing:
        return None
    try:
        return rules.read(answer.status, answer.body).verdict
    except Exception:
        log.exception("list answer rules failed", extra={"policy": policy.name})
        return None


def _step(policy: Policy, tenant: str, cursor: str | None, cutoff: datetime, scope: str,
          verdict: Classified, answer: Answer, paused: str | None) -> Listed:
    """What a list call's classified answer makes of the tenant's walk (the table of the
    module docstring): its page read, the tenant skipped, or SourceDeferred."""
    source = policy.list_source
    assert source is not None
    where = f"tenant {tenant!r}: list call {verdict.reason}"
    if verdict.outcome is Outcome.SUCCEEDED:
        document = read_json(answer.body) if answer.body is not None else NOT_JSON
        if document is NOT_JSON:
            raise SourceDeferred(policy.name, f"{where}: the page is not JSON of at most "
                                              f"{source.max_bytes} bytes")
        return read_page(policy, tenant, cursor, document, cutoff)
    if verdict.outcome is Outcome.THROTTLED:
        raise SourceDeferred(policy.name, f"{where}: scope {scope!r} closed; discovery "
                                          "waits for it to reopen")
    if verdict.outcome is Outcome.UNAUTHORIZED:
        return _skipped(tenant, f"list call {verdict.reason}: scope {scope!r} paused "
                                f"({paused}); this tenant is not walked in this run")
    if verdict.outcome is Outcome.PERMANENT:
        return _skipped(tenant, f"list call refused ({verdict.reason}); this tenant is "
                                "not walked in this run")
    raise SourceDeferred(policy.name, f"{where}; tried again on the publisher's next pass")


def describe_requests(policies: Policies) -> Sequence[str]:
    """Each list source's first request as it is sent (for `sweeper check-config`): its
    first tenant, no cursor, the cutoff of a run now; credentials never shown."""
    shown_requests = []
    now = datetime.now(UTC)
    for name, policy in sorted(policies.policies.items()):
        source, listing = policy.list_source, policy.listing
        if source is None or listing is None:
            continue
        tenant = sorted(source.tenants)[0]
        cutoff = listing.cutoff(now)
        body = listing.body(tenant, None, cutoff, source.page)
        shown_requests.append(
            f"policies.{name}.source on upstream {listing.upstream!r} "
            f"({len(source.tenants)} tenant(s); the first page of {tenant!r}):\n"
            f"  {listing.method} {listing.url(tenant, None, cutoff, source.page)}"
            + (f"\n  {body.decode('ascii')}" if body is not None else ""))
    return shown_requests
