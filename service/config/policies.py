"""The TOML policies file resolved: upstreams, stores, retention policies and webhook sources.

Parsed with stdlib ``tomllib`` and validated against its schema (`service.config.policy_file`:
unknown keys are refused, so a typo never silently falls back to a default), then resolved
section by section (`upstreams`, `stores`, `retention_policies`, `webhook_sources`: names
checked, keys that must agree checked together, templates compiled). Secrets are never
written in the file: it names environment variables, which are resolved too, and a missing
one is an error. Problems raise one :class:`ConfigError` listing each (the file, the key and
what is wrong), so a file is fixed in one pass.

The types each section resolves to are defined beside their resolvers and imported from
here by the rest of the service.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.config.policy_file import NAME_PATTERN, SOURCE_KINDS, PoliciesFile
from service.config.resolution import Resolution
from service.config.retention_policies import Policy, resolve_policy
from service.config.stores import Store, resolve_store
from service.config.tenants import host_form
from service.config.upstreams import Upstream, resolve_upstream
from service.config.webhook_sources import WebhookSource, resolve_webhook_source
from service.errors import ConfigError

__all__ = ["Policies", "Policy", "Store", "Upstream", "WebhookSource", "load_policies",
           "resolve_policies"]


@dataclass(frozen=True)
class Policies:
    """Everything the policies file declares, validated and with secrets resolved."""

    upstreams: Mapping[str, Upstream]
    policies: Mapping[str, Policy]
    webhooks: Mapping[str, WebhookSource]
    source: str = "<none>"
    stores: Mapping[str, Store] = field(default_factory=dict)

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
    """Read, validate and resolve the policies file; no file means no policies."""
    if path is None:
        return Policies.empty()
    env = os.environ if environ is None else environ
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"policies file {path}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"policies file {path}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"policies file {path}: not valid TOML: {exc}") from None
    return resolve_policies(raw, env, source=str(path))


def resolve_policies(raw: Mapping[str, Any], env: Mapping[str, str], *, source: str) -> Policies:
    """Validate a parsed file, resolve names and secrets; ConfigError listing every fault."""
    try:
        parsed = PoliciesFile.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(*(f"policies file {source}: {problem}"
                            for problem in _schema_problems(exc))) from None
    r = Resolution(source, env)
    for section in ("upstreams", "stores", "policies", "webhooks"):
        for name in getattr(parsed, section):
            if not re.match(NAME_PATTERN, name):
                r.fail(f"{section}.{name}", "names are lower-case letters, digits, '-', '_' "
                                            "or '.', at most 63 characters")
    upstreams = {name: upstream for name, config in parsed.upstreams.items()
                 if (upstream := resolve_upstream(name, config, r)) is not None}
    stores = {name: resolve_store(name, config, r) for name, config in parsed.stores.items()}
    policies = {name: policy for name, config in parsed.policies.items()
                if (policy := resolve_policy(name, config, upstreams, parsed, r)) is not None}
    webhooks = {name: resolve_webhook_source(name, config, parsed.policies, r)
                for name, config in parsed.webhooks.items()}
    if r.problems:
        raise ConfigError(*r.problems)
    return Policies(upstreams=upstreams, policies=policies, webhooks=webhooks, source=source,
                    stores=stores)


def _schema_problems(exc: ValidationError) -> list[str]:
    """Each schema error as `key: message`, the key in the file's own notation."""
    problems = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = [p for i, p in enumerate(err["loc"])
               if not (i and err["loc"][i - 1] == "source" and p in SOURCE_KINDS)]
        key = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc)
        key = key.replace(".[", "[")
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see docs/configuration.md)"
        elif err["type"] == "missing":
            message = "required key is missing"
        problems.append(f"{key}: {message}")
    return problems
