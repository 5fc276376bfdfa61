"""Sorting a discovered page: which of a source's rows can become items of the policy, due
when, and the problem of each row that cannot (a missing or malformed id or age, a tenant
whose scope or host the policy refuses, an object id its store target's type cannot take).
Pure: discovery (service/runs/discovery.py) reads the page and applies what this returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, cast

from service.config.policies import Policy
from service.config.policy_file import MAX_SCOPE_BYTES
from service.ledger import registration
from service.ledger.registration import Obligations
from service.sweeps.store_databases import Cursor, SourceRows

SHOWN_ID_CHARS: Final = 64  # of a malformed id, only this much is kept (repr'd)


@dataclass(frozen=True)
class Page:
    """One page read and sorted into what can be registered and what cannot.
    `in_age_order`: the registrations are in age order (a store's keyset pages)."""

    registrations: Obligations
    ages: Sequence[datetime]
    errors: list[dict[str, str]]
    last: Cursor
    rows: int
    in_age_order: bool = False


def _shown(value: object) -> str:
    return repr(value)[:SHOWN_ID_CHARS]


EMPTY_PAGE: Final = Page(Obligations([], [], [], [], {}), [], [], Cursor(), 0)


def sort_page(policy: Policy, rows: SourceRows, cutoff: datetime, *,
              in_age_order: bool = False) -> Page:
    """The rows that can become items of `policy`, due at their age (at the latest the
    run's cutoff, so this run releases them), and the problems of those that cannot (the
    first of each row's, in row order). Columns are checked whole; only rows with a
    problem are looked at one by one."""
    tenants, objects, ages = _spelled(policy, rows)
    problems = _row_problems(policy, tenants, objects, ages)
    kept_tenants = cast("Sequence[str]", tenants)
    kept_objects = cast("Sequence[str]", objects)
    kept_ages = cast("Sequence[datetime]", ages)
    if problems:
        kept_tenants, kept_objects, kept_ages = _without(problems, kept_tenants, kept_objects,
                                                         kept_ages)
    errors = [{"tenant_id": _shown(tenants[n]), "object_id": _shown(objects[n]),
               "problem": problems[n]} for n in sorted(problems)]
    refused = _refused(policy, kept_tenants, kept_objects)
    if refused:
        for n in sorted(refused):
            errors.append({"tenant_id": _shown(kept_tenants[n]),
                           "object_id": _shown(kept_objects[n]), "problem": refused[n]})
        kept_tenants, kept_objects, kept_ages = _without(refused, kept_tenants, kept_objects,
                                                         kept_ages)
    # due at the age, or at the cutoff for an age past it: a page is nearly always all
    # before the cutoff (the predicate's own), and then its ages are its due times
    dues = kept_ages if not kept_ages or max(kept_ages) <= cutoff \
        else [min(age, cutoff) for age in kept_ages]
    return Page(
        registrations=Obligations(kept_tenants, kept_objects,
                                  [policy.name] * len(kept_tenants), dues,
                                  {policy.name: policy}),
        ages=kept_ages, errors=errors, rows=len(rows), last=rows.last,
        in_age_order=in_age_order)


Column = Sequence[str | None]


def _spelled(policy: Policy, rows: SourceRows
             ) -> tuple[Column, Column, Sequence[datetime | None]]:
    """The page's columns with each id as the policy stores it: a tenant id in its one
    spelling (service/config/tenants.py), an object id in lower case where the upstream
    ignores case."""
    tenants, objects = rows.tenant_ids, rows.object_ids
    if policy.tenant_in_host:
        tenants = [None if t is None else policy.tenant(t) for t in tenants]
    if policy.config.object_id_case == "insensitive":
        objects = [None if o is None else policy.object_id(o) for o in objects]
    return tenants, objects, rows.ages


def _row_problems(policy: Policy, tenants: Column, objects: Column,
                  ages: Sequence[datetime | None]) -> dict[int, str]:
    """Each row that cannot be an item at all, by index: a missing or malformed id, no age,
    or a tenant whose scope would be too long (the first problem of each row)."""
    problems: dict[int, str] = {}
    for name, column in (("tenant_id", tenants), ("object_id", objects)):
        for n, found in registration.id_problems(column):
            problems.setdefault(n, f"{name} {found}")
    if None in ages:
        for n, age in enumerate(ages):
            if age is None:
                problems.setdefault(n, "age is NULL")
    # per distinct tenant (a page holds few); a malformed one has its problem already, and
    # one with a lone surrogate could not be measured in UTF-8
    too_long = {tenant for tenant in set(tenants)
                if tenant is not None and registration.id_problem(tenant) is None
                and registration.utf8_size_over(policy.scope_for(tenant), MAX_SCOPE_BYTES)}
    if too_long:
        for n, tenant in enumerate(tenants):
            if tenant in too_long:
                problems.setdefault(
                    n, f"tenant_id makes a scope over {MAX_SCOPE_BYTES} bytes")
    return problems


def _refused(policy: Policy, tenants: Sequence[str], objects: Sequence[str]
             ) -> dict[int, str]:
    """Each well-formed row the policy's upstream or store could never be called with, by
    index: a host its ids make that the upstream refuses, an object id its store target's
    type cannot take."""
    names = [policy.name] * len(tenants)
    refused = {n: f"{field} {problem}" for n, field, problem in registration.host_problems(
        tenants, objects, names, {policy.name: policy})}
    refused.update((n, f"object_id {problem}") for n, problem in registration.id_type_problems(
        objects, names, {policy.name: policy}) if n not in refused)
    return refused


def _without(dropped: Mapping[int, str], tenants: Sequence[str], objects: Sequence[str],
             ages: Sequence[datetime]) -> tuple[list[str], list[str], list[datetime]]:
    """The three columns without the rows at `dropped`'s indices."""
    keep = [n for n in range(len(tenants)) if n not in dropped]
    return [tenants[n] for n in keep], [objects[n] for n in keep], [ages[n] for n in keep]


def per_tenant(page: Page) -> dict[str, Any]:
    """The page's candidates per tenant, with each tenant's oldest and newest age, as
    columns (`discovery.tenants`' parameters)."""
    tenants, ages = page.registrations.tenant_ids, page.ages
    counts = Counter(tenants)
    if page.in_age_order:
        # each tenant's first row is its oldest and its last its newest
        oldest = dict(zip(reversed(tenants), reversed(ages), strict=True))
        newest = dict(zip(tenants, ages, strict=True))
    else:
        oldest, newest = {}, {}
        for tenant, age in zip(tenants, ages, strict=True):
            if tenant not in oldest or age < oldest[tenant]:
                oldest[tenant] = age
            if tenant not in newest or age > newest[tenant]:
                newest[tenant] = age
    names = sorted(counts)
    return {"tenants": names, "counts": [counts[t] for t in names],
            "oldests": [oldest[t] for t in names], "newests": [newest[t] for t in names]}
