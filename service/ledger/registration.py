"""Item registration and identity: the obligations Sweeper owes.

An item's operation key is a digest of exactly (tenant, object id, policy, policy version):
every attempt, from any worker, after any crash, sends the same key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, cast

from pydantic import AwareDatetime, TypeAdapter
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.budget import buckets
from service.budget.rules import budget_of
from service.config.policies import Policy
from service.config.policy_file import MAX_SCOPE_BYTES, UNSTORABLE
from service.db.statements import LEASED, Statement, covering_hold, run

if TYPE_CHECKING:
    from _hashlib import HASH

MAX_ID_BYTES = 512


def operation_key(tenant_id: str, object_id: str, policy: str, version: int) -> str:
    """Stable idempotency key: SHA-256 over the four fields, each prefixed by its length in
    4 bytes, so no two tuples collide."""
    return operation_keys([tenant_id], [object_id], [policy], [version])[0]


def operation_keys(tenant_ids: Sequence[str], object_ids: Sequence[str],
                   policies: Sequence[str], versions: Sequence[int]) -> list[str]:
    """`operation_key` of each obligation, for a whole request at once: each tenant's
    prefix is hashed once and its digest state copied for each of its keys (the same keys as
    hashing each from the start)."""
    heads: dict[str, HASH] = {}
    tails: dict[tuple[str, int], bytes] = {}
    keys = []
    for tenant, obj, policy, version in zip(tenant_ids, object_ids, policies, versions,
                                            strict=True):
        head = heads.get(tenant)
        if head is None:
            head = heads[tenant] = hashlib.sha256(_prefixed(tenant))
        tail = tails.get((policy, version))
        if tail is None:
            tail = tails[policy, version] = _prefixed(policy) + _prefixed(str(version))
        digest = head.copy()
        digest.update(_prefixed(obj) + tail)
        keys.append(digest.hexdigest())
    return keys


def _prefixed(field: str) -> bytes:
    raw = field.encode("utf-8")
    return len(raw).to_bytes(4, "big") + raw


def utf8_size_over(value: str, limit: int) -> bool:
    """Whether `value` takes more than `limit` bytes in UTF-8. At most 4 bytes per
    character: a short value needs no encoding to be measured."""
    return len(value) > limit // 4 and len(value.encode("utf-8")) > limit


DOT_SEGMENTS = frozenset((".", ".."))


def id_problem(value: str) -> str | None:
    """Why `value` cannot be a tenant or object id, or None when it can. (Runs twice per
    registered item: a regular-expression search, not a Python loop over characters.)"""
    if not value:
        return "must not be empty"
    if value in DOT_SEGMENTS:
        # a dot segment would be normalised away in the upstream URL, leaving its segment
        return "must not be . or .."
    if UNSTORABLE.search(value):  # first: a surrogate cannot be encoded to be measured
        return "must not contain control characters or unpaired surrogates"
    if utf8_size_over(value, MAX_ID_BYTES):
        return f"must be at most {MAX_ID_BYTES} bytes"
    return None


def id_problems(values: Sequence[str | None]) -> Iterator[tuple[int, str]]:
    """(index, problem) of each value of a column that cannot be a tenant or object id
    (None: "is NULL"). The whole column is checked at once first (a source's page of
    thousands is nearly always clean); only a column that fails is looked at value by
    value."""
    if None not in values:
        column = cast("Sequence[str]", values)
        if not column or (min(map(len, column)) > 0
                          and max(map(len, column)) <= MAX_ID_BYTES // 4
                          and "." not in column and ".." not in column
                          and not UNSTORABLE.search("".join(column))):
            return
    for n, value in enumerate(values):
        problem = "is NULL" if value is None else id_problem(value)
        if problem is not None:
            yield n, problem


@dataclass(frozen=True)
class Registration:
    """One obligation to register."""

    tenant_id: str
    object_id: str
    policy: Policy
    due_at: datetime


class ScopeTooLong(ValueError):
    """A tenant id that fits, but whose limiter scope under a policy (the policy's scope
    template filled in) would pass 512 bytes; nothing was written."""

    def __init__(self, policy: str, tenant_id: str, size: int) -> None:
        super().__init__(f"makes the limiter scope of policy {policy!r} {size} bytes long; "
                         f"at most {MAX_SCOPE_BYTES}")
        self.policy = policy
        self.tenant_id = tenant_id


class HostRefused(ValueError):
    """An obligation whose tenant (or object) id would make a host its policy's upstream
    refuses (service/config/request_templates.py); nothing was written."""

    def __init__(self, index: int, field: str, problem: str) -> None:
        super().__init__(problem)
        self.index = index
        self.field = field


class ObjectIdRefused(ValueError):
    """An obligation whose object id its policy's store target could never take (the type
    its statement casts ids to: service/config/store_statements.py); nothing was written."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index = index


def id_type_problems(object_ids: Sequence[str], policy_names: Sequence[str],
                     policies: Mapping[str, Policy | None]) -> Iterator[tuple[int, str]]:
    """(index, problem) of each obligation whose object id its policy's store target cannot
    take. Nothing to do for policies whose type is not known."""
    typed = {name: policy for name, policy in policies.items()
             if policy is not None and policy.object_id_type is not None}
    if not typed:
        return
    for n, name in enumerate(policy_names):
        policy = typed.get(name)
        problem = policy.object_id_problem(object_ids[n]) if policy is not None else None
        if problem is not None:
            yield n, problem


def host_problems(tenant_ids: Sequence[str], object_ids: Sequence[str],
                  policy_names: Sequence[str], policies: Mapping[str, Policy | None]
                  ) -> Iterator[tuple[int, str, str]]:
    """(index, field, problem) of each obligation whose policy's upstream has a templated
    host and refuses the host its ids make. Nothing to do for fixed hosts; each distinct
    host is checked once."""
    templated = {name: policy.request for name, policy in policies.items()
                 if policy is not None and policy.request is not None
                 and policy.request.host_format is not None}
    if not templated:
        return
    seen: dict[tuple[str, str, str], str | None] = {}
    for n, name in enumerate(policy_names):
        request = templated.get(name)
        if request is None:
            continue
        tenant = tenant_ids[n] if "tenant_id" in request.host_uses else ""
        obj = object_ids[n] if "object_id" in request.host_uses else ""
        key = (name, tenant, obj)
        if key not in seen:
            seen[key] = request.host_problem(tenant, obj)
        problem = seen[key]
        if problem is not None:
            yield n, request.host_field, problem


@dataclass(frozen=True)
class RegistrationResult:
    """How many rows were new, had their due_at moved earlier, or stayed as they were."""

    inserted: int
    advanced: int
    unchanged: int


@dataclass(frozen=True)
class Obligations:
    """Obligations to register, column by column: a request of 10,000 items becomes a few
    lists rather than 10,000 objects. `policies` resolves every name in `policy_names`."""

    tenant_ids: Sequence[str]
    object_ids: Sequence[str]
    policy_names: Sequence[str]
    due_ats: Sequence[datetime]
    policies: Mapping[str, Policy]

    @classmethod
    def of(cls, registrations: Sequence[Registration]) -> Obligations:
        return cls([r.tenant_id for r in registrations], [r.object_id for r in registrations],
                   [r.policy.name for r in registrations], [r.due_at for r in registrations],
                   {r.policy.name: r.policy for r in registrations})

    def __len__(self) -> int:
        return len(self.tenant_ids)

    def canonical(self) -> Obligations:
        """The same obligations with each tenant id and object id as its policy stores it
        (`Policy.tenant`: one spelling where the id makes a host; `Policy.object_id`: lower
        case where the upstream ignores case)."""
        used = [self.policies[name] for name in set(self.policy_names)]
        tenants, objects = self.tenant_ids, self.object_ids
        if any(policy.tenant_in_host for policy in used):
            tenants = [self.policies[name].tenant(tenant)
                       for tenant, name in zip(tenants, self.policy_names, strict=True)]
        if any(policy.config.object_id_case == "insensitive" for policy in used):
            objects = [self.policies[name].object_id(obj)
                       for obj, name in zip(objects, self.policy_names, strict=True)]
        if tenants is self.tenant_ids and objects is self.object_ids:
            return self
        return Obligations(tenants, objects, self.policy_names, self.due_ats, self.policies)

    def earliest_per_obligation(self) -> Obligations:
        """One row per obligation, with the earliest due_at (an INSERT may not touch a row
        twice). A request rarely names an item twice, so that is checked first."""
        names = list(zip(self.tenant_ids, self.object_ids, self.policy_names, strict=True))
        if len(set(names)) == len(names):
            return self
        earliest: dict[tuple[str, str, str], int] = {}
        for n, name in enumerate(names):
            kept = earliest.get(name)
            if kept is None or self.due_ats[n] < self.due_ats[kept]:
                earliest[name] = n
        rows = sorted(earliest.values())
        return Obligations([self.tenant_ids[n] for n in rows],
                           [self.object_ids[n] for n in rows],
                           [self.policy_names[n] for n in rows],
                           [self.due_ats[n] for n in rows], self.policies)


# One statement for the whole request (all-or-nothing). A second registration never
# postpones: due_at only moves earlier, and only while the item is still pending. An item a
# store target skipped (its row was active again) is re-armed: pending, unreleased, its
# attempts reset, so the next run deletes it if its predicate holds by then. Only the
# counts travel back, not a row per item.
#
# The columns travel as text, each one string joined by U+001F and split by PostgreSQL:
# the API's one process then pays for a join, not for asyncpg encoding an array element by
# element. No id, policy name, scope or key contains a control character (the API refuses
# them, the schema CHECKs them, and `_column` refuses U+001F).
_REGISTER = Statement("registration.register", (
    "Insert a request's obligations or move their due_at earlier (pending items only), "
    "all or nothing, returning only the counts; a new item under a legal hold is marked."),
    f"""
    WITH changed AS (
        INSERT INTO items AS i (tenant_id, object_id, policy, policy_version, operation_key,
                                scope, due_at, region, hold_id)
        SELECT u.tenant_id, u.object_id, u.policy, u.policy_version, u.operation_key,
               u.scope, u.due_at, nullif(u.region, ''), {covering_hold("u")}
        FROM unnest(string_to_array(:tenants, chr(31)),
                    string_to_array(:objects, chr(31)),
                    string_to_array(:policies, chr(31)),
                    CAST(:versions AS integer[]),
                    string_to_array(:keys, chr(31)),
                    string_to_array(:scopes, chr(31)),
                    CAST(string_to_array(:dues, chr(31)) AS timestamptz[]),
                    -- '' when no tenant is pinned: an empty array, NULL for every row
                    string_to_array(:regions, chr(31)))
             AS u(tenant_id, object_id, policy, policy_version, operation_key, scope, due_at,
                  region)
        ON CONFLICT (tenant_id, object_id, policy, policy_version) DO UPDATE
            SET due_at = EXCLUDED.due_at, updated_at = now(), status = 'pending',
                released_at = CASE WHEN i.status = 'skipped' THEN NULL ELSE i.released_at END,
                batch_id = CASE WHEN i.status = 'skipped' THEN NULL ELSE i.batch_id END,
                attempts = CASE WHEN i.status = 'skipped' THEN 0 ELSE i.attempts END,
                next_attempt_at = CASE WHEN i.status = 'skipped' THEN '-infinity'
                                       ELSE i.next_attempt_at END,
                completed_at = NULL,
                hold_id = CASE WHEN i.status = 'skipped' THEN EXCLUDED.hold_id
                               ELSE i.hold_id END
            -- a leased item is in flight: its due_at no longer matters
            WHERE (EXCLUDED.due_at < i.due_at AND i.status = 'pending'
                   AND NOT {LEASED})
               OR i.status = 'skipped'
        RETURNING (xmax = 0) AS inserted
    )
    SELECT count(*) FILTER (WHERE inserted) AS inserted, count(*) AS changed FROM changed
""")  # noqa: S608 - only a constant fragment is interpolated
_SEPARATOR = "\x1f"
# RFC 3339 text for each timestamp, written by pydantic-core in one call per column
_TIMESTAMPS = TypeAdapter(list[AwareDatetime])


def _column(values: Sequence[str]) -> str:
    joined = _SEPARATOR.join(values)
    if joined.count(_SEPARATOR) != max(len(values) - 1, 0):
        raise ValueError("a registered value contains U+001F")
    return joined


def _regions(rows: Obligations, pairs: Sequence[tuple[str, str]]) -> str:
    """The regions column (service/config/regions.py): each row's region, '' for a tenant
    pinned nowhere; '' for the whole column when no tenant is pinned."""
    region_of = {pair: rows.policies[pair[0]].region(pair[1]) or "" for pair in set(pairs)}
    if not any(region_of.values()):
        return ""
    return _column([region_of[pair] for pair in pairs])


async def register(engine: AsyncEngine, obligations: Obligations | Sequence[Registration]
                   ) -> RegistrationResult:
    """Register obligations idempotently in one transaction. ValueError (ScopeTooLong and
    HostRefused among them) for a value the ledger cannot hold or the upstream could never be
    called with, before anything is written."""
    async with engine.begin() as conn:
        return await register_in(conn, obligations)


async def register_in(conn: AsyncConnection,
                      obligations: Obligations | Sequence[Registration]) -> RegistrationResult:
    """`register` inside the caller's transaction (discovery registers a page in the
    transaction that moves its cursor on)."""
    given = (obligations if isinstance(obligations, Obligations)
             else Obligations.of(obligations)).canonical()
    if any(due.tzinfo is None for due in given.due_ats):
        raise ValueError("due_at must be timezone-aware")
    for n, field, problem in host_problems(given.tenant_ids, given.object_ids,
                                           given.policy_names, given.policies):
        raise HostRefused(n, field, problem)
    for n, problem in id_type_problems(given.object_ids, given.policy_names,
                                       given.policies):
        raise ObjectIdRefused(n, problem)
    rows = given.earliest_per_obligation()
    policies = [rows.policies[name] for name in rows.policy_names]
    versions = [policy.version for policy in policies]
    # the scope of each (policy, tenant) pair, formatted once: a request holds few pairs
    pairs = list(zip(rows.policy_names, rows.tenant_ids, strict=True))
    scope_of = {pair: rows.policies[pair[0]].scope_for(pair[1]) for pair in set(pairs)}
    for (name, tenant), scope in scope_of.items():
        if utf8_size_over(scope, MAX_SCOPE_BYTES):
            raise ScopeTooLong(name, tenant, len(scope.encode("utf-8")))
    budgets = {scope: budget_of(rows.policies[name])
               for (name, _), scope in scope_of.items()}
    params = {
        "tenants": _column(rows.tenant_ids),
        "objects": _column(rows.object_ids),
        "policies": _column(rows.policy_names),
        "versions": versions,
        "keys": _column(operation_keys(rows.tenant_ids, rows.object_ids, rows.policy_names,
                                       versions)),
        "scopes": _column([scope_of[pair] for pair in pairs]),
        "dues": _column(_TIMESTAMPS.dump_python(list(rows.due_ats), mode="json")),
        "regions": _regions(rows, pairs),
    }
    await buckets.ensure_scopes(conn, budgets)
    counts = (await run(conn, _REGISTER, params)).one()
    inserted = int(counts.inserted)
    advanced = int(counts.changed) - inserted
    return RegistrationResult(inserted=inserted, advanced=advanced,
                              unchanged=len(given) - inserted - advanced)
