"""The TOML policies file resolved: upstreams, stores, retention policies and webhook sources.

Parsed with stdlib ``tomllib`` and validated against its schema entry by entry
(`service.config.file_entries`: unknown keys are refused, so a typo never silently falls back
to a default, and one entry's mistakes never hide another's), then resolved section by
section (`upstreams`, `stores`, `retention_policies`, `webhook_sources`: names checked, keys
that must agree checked together, templates compiled). Secrets are never written in the
file: it names environment variables, which are resolved too, and a missing one is an error.
Every problem of every entry is listed at once (the file, the key and what is wrong), so a
file is fixed in one pass: `load_policies` and `resolve_policies` raise one
:class:`ConfigError` listing them; `read_policies` and `resolve_checked` return them beside
what resolved, for check-config to check further.

The types each section resolves to are defined beside their resolvers and imported from
here by the rest of the service.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from service.config.file_entries import (
    Written,
    name_problems,
    names_given,
    reference_problems,
    rule_problems,
    validate_entries,
)
from service.config.regions import Regions
from service.config.resolution import Resolution
from service.config.retention_policies import Policy, resolve_policy
from service.config.stores import Store, resolve_store
from service.config.tenants import host_form
from service.config.upstreams import Upstream, resolve_upstreams
from service.config.webhook_sources import WebhookSource, resolve_webhook_source
from service.errors import ConfigError

__all__ = ["Policies", "Policy", "Store", "Upstream", "WebhookSource", "load_policies",
           "read_policies", "resolve_checked", "resolve_policies"]


@dataclass(frozen=True)
class Policies:
    """Everything the policies file declares, validated and with secrets resolved."""

    upstreams: Mapping[str, Upstream]
    policies: Mapping[str, Policy]
    webhooks: Mapping[str, WebhookSource]
    source: str = "<none>"
    stores: Mapping[str, Store] = field(default_factory=dict)
    regions: Regions = field(default_factory=Regions)  # where tenants' items may be processed

    @classmethod
    def empty(cls) -> Policies:
        return cls(upstreams={}, policies={}, webhooks={}, source="<none>")

    def policy(self, name: str) -> Policy | None:
        return self.policies.get(name)

    @cached_property
    def tenant_in_host(self) -> tuple[str, ...]:
        """The policies whose host is built from the tenant id, by name."""
        return tuple(sorted(name for name, policy in self.policies.items()
                            if policy.tenant_in_host))

    @cached_property
    def case_insensitive_ids(self) -> tuple[str, ...]:
        """The policies whose upstream treats object ids case-insensitively, by name."""
        return tuple(sorted(name for name, policy in self.policies.items()
                            if policy.config.object_id_case == "insensitive"))

    def object_id(self, object_id: str, policy: str | None) -> str:
        """The object id (or id prefix) an entry naming it (and a policy, or every policy)
        stores and compares: that policy's spelling (`Policy.object_id`); without one, the
        id as given, or ValueError when a case-insensitive policy would spell it otherwise."""
        known = self.policies.get(policy) if policy is not None else None
        if known is not None:
            return known.object_id(object_id)
        lowered = object_id.lower()
        if lowered == object_id or not self.case_insensitive_ids:
            return object_id
        raise ValueError(
            f"is not in the lower case that policies {', '.join(self.case_insensitive_ids)} "
            "store it in (object_id_case = \"insensitive\"): send it lower-cased, or name a "
            "policy")

    def tenant(self, tenant_id: str, policy: str | None) -> str:
        """The tenant id an entry naming it (and a policy, or every policy) stores and
        compares: with a known policy, that policy's spelling (`Policy.tenant`); without
        one, the id as given, or ValueError when a policy whose host is built from tenant
        ids would spell it differently (the entry would miss that policy's items)."""
        known = self.policies.get(policy) if policy is not None else None
        if known is not None:
            return known.tenant(tenant_id)
        canonical = host_form(tenant_id)
        if canonical == tenant_id or not self.tenant_in_host:
            return tenant_id
        raise ValueError(
            f"is not in the canonical form {canonical!r} that policies "
            f"{', '.join(self.tenant_in_host)} store it in (their upstream's host is built "
            "from the tenant id): use that form, or name a policy")


def load_policies(path: Path | None, environ: Mapping[str, str] | None = None) -> Policies:
    """Read, validate and resolve the policies file; no file means no policies.
    ConfigError listing every problem."""
    policies, problems = read_policies(path, environ)
    if problems:
        raise ConfigError(*problems)
    return policies


def read_policies(path: Path | None, environ: Mapping[str, str] | None = None
                  ) -> tuple[Policies, list[str]]:
    """The entries of the policies file that resolved, and every problem found in it (a
    file that cannot be read or parsed is one problem); no file means no policies."""
    if path is None:
        return Policies.empty(), []
    env = os.environ if environ is None else environ
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Policies.empty(), [f"policies file {path}: not found"]
    except (OSError, UnicodeDecodeError) as exc:
        return Policies.empty(), [f"policies file {path}: cannot be read ({exc})"]
    except tomllib.TOMLDecodeError as exc:
        return Policies.empty(), [f"policies file {path}: not valid TOML: {exc}"]
    return resolve_checked(raw, env, source=str(path))


def resolve_policies(raw: Mapping[str, Any], env: Mapping[str, str], *, source: str) -> Policies:
    """Validate a parsed file, resolve names and secrets; ConfigError listing every fault."""
    policies, problems = resolve_checked(raw, env, source=source)
    if problems:
        raise ConfigError(*problems)
    return policies


def resolve_checked(raw: Mapping[str, Any], env: Mapping[str, str], *, source: str
                    ) -> tuple[Policies, list[str]]:
    """Validate a parsed file and resolve names and secrets: what resolved, and every
    problem found. Each entry is checked on its own, so one entry's mistakes never hide
    another's; a problem stops only the checks of its own entry that it makes meaningless.
    What resolved leaves out every entry with a problem, and those naming one."""
    r = Resolution(source, env)
    parsed, written = validate_entries(raw, r)
    name_problems(written, r)
    upstreams, troubled = resolve_upstreams(parsed.upstreams, r)
    stores = {name: store for name, config in parsed.stores.items()
              if (store := resolve_store(name, config, r)) is not None}
    regions, region_problems = Regions.of(parsed.regions)
    for key, message in region_problems:
        r.fail(key, message)
    policies: dict[str, Policy] = {}
    # every entry as written: one that does not fit the schema still has its names checked
    for name in written["policies"]:
        reference_problems(name, written, r)
        pol = parsed.policies.get(name)
        if pol is not None and (policy := resolve_policy(name, pol, upstreams, r)) is not None:
            policies[name] = replace(policy, regions=regions)
    webhooks: dict[str, WebhookSource] = {}
    for name in written["webhooks"]:
        rule_problems(name, written, r)
        src = parsed.webhooks.get(name)
        if src is not None and (webhook := resolve_webhook_source(name, src, r)) is not None:
            webhooks[name] = webhook
    upstreams = {name: upstream for name, upstream in upstreams.items() if name not in troubled}
    return _resolved(Policies(upstreams=upstreams, policies=policies, webhooks=webhooks,
                              source=source, stores=stores, regions=regions),
                     written), r.problems


def _resolved(found: Policies, written: Written) -> Policies:
    """`found` less the policies naming an upstream or a store that did not resolve, and
    the webhook sources whose rules name a policy that did not."""
    named: dict[str, Mapping[str, object]] = {"upstreams": found.upstreams,
                                              "stores": found.stores}
    policies = {name: policy for name, policy in found.policies.items()
                if all(given in named[section]
                       for _, section, given in names_given(written["policies"][name]))}
    webhooks = {name: webhook for name, webhook in found.webhooks.items()
                if all(rule.policy in policies for rule in webhook.config.rules)}
    return replace(found, policies=policies, webhooks=webhooks)
