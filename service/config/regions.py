"""Regions: where a tenant's items may be processed. The policies file pins tenants to a
region (`[regions] eu = ["acme", ...]`); a process started with SWEEPER_REGION serves
that region's tenants only, and a process without one serves the tenants pinned nowhere.
The ledger stores each item's region when it is written (`items.region`, migration 0029),
and every claim of either execution mode compares it with the claimer's.

A pin names a tenant in every spelling a host name would share (`host_form`: case, a
trailing dot, IDNA): pinning `acme` pins `ACME` and `acme.` too, under every policy, so no
spelling of a pinned tenant is processed outside its region. Two regions that would share
a spelling are refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final

from service.config.tenants import host_form

# A region's name: it names queues and settings, so a short, plain token.
REGION_PATTERN: Final = r"^[a-z](?:[a-z0-9-]{0,30}[a-z0-9])?$"
REGION_RULE: Final = ("1-32 lower-case letters, digits or '-', starting with a letter and "
                      "not ending with '-'")
MAX_TENANTS_PER_REGION: Final = 100_000
MAX_TENANT_CHARS: Final = 512  # as the API's ids (service/http/api/bodies.py)
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def region_problem(name: str) -> str | None:
    """Why `name` cannot be a region's name, or None."""
    # fullmatch: `$` alone would let a trailing line break through into queue names
    return None if re.fullmatch(REGION_PATTERN, name) else f"a region's name is {REGION_RULE}"


def tenant_problem(tenant_id: str) -> str | None:
    """Why `tenant_id` cannot be pinned, or None."""
    if not tenant_id or len(tenant_id) > MAX_TENANT_CHARS:
        return f"a tenant id is 1-{MAX_TENANT_CHARS} characters"
    if _CONTROL.search(tenant_id):
        return "a tenant id holds no control character"
    if tenant_id != tenant_id.strip():
        # a typo that would pin a tenant nobody registers, and leave the real one unpinned
        return "a tenant id neither starts nor ends with a space"
    return None


@dataclass(frozen=True)
class Regions:
    """The regions the policies file declares, and the tenants pinned to each."""

    pins: Mapping[str, str] = field(default_factory=dict)  # host_form(tenant) -> region
    names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, declared: Mapping[str, Iterable[str]]
           ) -> tuple[Regions, list[tuple[str, str]]]:
        """The regions of `declared` (region -> tenant ids as written), and the problems
        found, each as (its key in the file, message)."""
        pins: dict[str, str] = {}
        written: dict[str, str] = {}
        problems: list[tuple[str, str]] = []
        for region, tenants in declared.items():
            if (problem := region_problem(region)) is not None:
                problems.append((f"regions.{region}", problem))
                continue
            for tenant in tenants:
                if (problem := tenant_problem(tenant)) is not None:
                    problems.append((f"regions.{region}", problem))
                    continue
                key = host_form(tenant)
                other = pins.setdefault(key, region)
                if other != region:
                    problems.append((f"regions.{region}", (
                        f"tenant {tenant!r} is pinned to region {other!r} too (as "
                        f"{written[key]!r}); a tenant has one region")))
                written.setdefault(key, tenant)
        names = frozenset(r for r in declared if region_problem(r) is None)
        return cls(pins=pins, names=names), problems

    @cached_property
    def digest(self) -> str:
        """A digest of the pins: the ledger records the last it moved items to."""
        return hashlib.sha256(json.dumps(sorted(self.pins.items())).encode()).hexdigest()

    @property
    def served(self) -> tuple[str | None, ...]:
        """Every region a worker may serve: None (the tenants pinned nowhere), then each
        declared one, in name order (the relay reads each one's dead-letter queue)."""
        return (None, *sorted(self.names))

    def of_tenant(self, tenant_id: str) -> str | None:
        """The region `tenant_id` is pinned to, in any of its spellings (None: none)."""
        if not self.pins:
            return None
        return self.pins.get(host_form(tenant_id))

    def serving_problems(self, region: str | None) -> list[str]:
        """Why a process may not serve `region` (SWEEPER_REGION) under these regions."""
        if region is None or region in self.names:
            return []
        declared = ", ".join(sorted(self.names)) or "none"
        return [f"SWEEPER_REGION={region} names a region the policies file does not declare "
                f"in [regions] (declared: {declared})"]
