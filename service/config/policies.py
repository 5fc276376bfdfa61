"""The TOML policies file resolved: upstreams, stores, retention policies and webhook sources.

Parsed with stdlib ``tomllib`` and validated against its schema (`service.config.policy_file`:
unknown keys are refused, so a typo never silently falls back to a default), then resolved
here: names checked, keys that must agree checked together, templates compiled. Secrets are
never written in the file: it names environment variables, which are resolved here, and a
missing one is an error.
Problems raise one :class:`ConfigError` listing each (the file, the key and what is wrong),
so a file is fixed in one pass.
"""

from __future__ import annotations

import hashlib
import os
import re
import ssl
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from service.config import store_statements
from service.config.answer_rules import NO_RULES, AnswerRules, compile_rules
from service.config.list_sources import ListRequest, ListSourceConfig, compile_list_request
from service.config.policy_file import (
    NAME_PATTERN,
    SOURCE_KINDS,
    PoliciesFile,
    PolicyConfig,
    SourceConfig,
    StoreConfig,
    UpstreamConfig,
    WebhookSourceConfig,
    parse_duration,
    template_fields,
)
from service.config.request_templates import (
    Origin,
    RequestTemplate,
    TemplateProblems,
    compile_origin,
    compile_request,
    parse_format,
)
from service.config.tenants import host_form
from service.errors import ConfigError
from service.protocols.egress import (
    Proxy,
    ProxyChoice,
    TlsProblem,
    environment_proxy,
    fixed_proxy,
    no_proxy,
    tls_context,
)
from service.protocols.webhook_signatures import standard_key


@dataclass(frozen=True)
class Upstream:
    """A resolved upstream: its config plus header values read from the environment, and
    its base_url compiled."""

    name: str
    config: UpstreamConfig
    headers: Mapping[str, str] = field(repr=False)
    origin: Origin = field(repr=False, compare=False)
    # header -> (text before, text after) the tenant's {credential}
    credential_headers: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # its TLS settings (ca_file, a client certificate); None: the public roots
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    @property
    def public_only(self) -> bool:
        """Whether its connections may reach only public addresses: a host built from the
        item's ids, without allow_private_addresses (service/protocols/egress.py)."""
        return self.origin.host is None and not self.config.allow_private_addresses

    @property
    def proxy(self) -> ProxyChoice:
        """How its connections leave: its `proxy`, or the environment's."""
        chosen = self.config.proxy
        return (environment_proxy if chosen is None else no_proxy if chosen == "none"
                else fixed_proxy(chosen))

    @property
    def per_tenant_credentials(self) -> bool:
        return self.config.credentials is not None

    @property
    def allow_private_addresses(self) -> bool:
        """Whether a templated host may be an IP literal or a single-label name, and may
        resolve to a loopback, private, link-local or metadata address (the transport
        checks the addresses it connects to; service/config/request_templates.py the host's
        form)."""
        return self.config.allow_private_addresses

    def tenant(self, tenant_id: str) -> str:
        """The tenant id as its credential for this upstream is stored and looked up: its
        canonical host form where the host is built from it (service/config/tenants.py)."""
        return host_form(tenant_id) if self.origin.tenant_in_host else tenant_id


@dataclass(frozen=True)
class Policy:
    """A resolved policy, ready for the worker and the publisher."""

    name: str
    config: PolicyConfig
    # what each HTTP call sends; None for a policy whose target is a store's database
    request: RequestTemplate | None = field(repr=False, compare=False)
    answers: AnswerRules = field(default=NO_RULES, repr=False, compare=False)  # how it is read
    # an HTTP list source's call and how its answers are read (None: no such source)
    listing: ListRequest | None = field(default=None, repr=False, compare=False)
    list_answers: AnswerRules = field(default=NO_RULES, repr=False, compare=False)
    # the confirmation read's call (None: the policy's deletions are not confirmed)
    confirm_request: RequestTemplate | None = field(default=None, repr=False, compare=False)

    def confirms(self, operation_key: str) -> bool:
        """Whether the deletion of the item with `operation_key` is confirmed by a read:
        its key's place in [0, 1) under the policy's `confirm.share`, so every attempt of
        the item (and every replica) decides the same."""
        confirm = self.config.confirm
        if confirm is None or confirm.share <= 0.0:
            return False
        if confirm.share >= 1.0:
            return True
        drawn = int.from_bytes(hashlib.sha256(operation_key.encode()).digest()[:8], "big")
        return drawn < confirm.share * 2.0**64

    @property
    def store_source(self) -> SourceConfig | None:
        """The policy's store source, if its candidates come from a store's query."""
        source = self.config.source
        return source if isinstance(source, SourceConfig) else None

    @property
    def list_source(self) -> ListSourceConfig | None:
        """The policy's HTTP list source, if an upstream lists its candidates."""
        source = self.config.source
        return source if isinstance(source, ListSourceConfig) else None

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def target_name(self) -> str:
        """The upstream it calls, or the store its statement runs on."""
        cfg = self.config
        return cfg.target.store if cfg.target is not None else str(cfg.upstream)

    @property
    def per_call(self) -> int:
        """How many objects one call (one HTTP request, one statement) carries at most."""
        return self.config.batch.max_objects if self.config.batch is not None else 1

    @cached_property
    def tenant_in_host(self) -> bool:
        """Whether its calls' host (deletion or list calls) is built from the tenant id."""
        return any(call is not None and call.origin.tenant_in_host
                   for call in (self.request, self.listing))

    def tenant(self, tenant_id: str) -> str:
        """The tenant id as this policy's items are stored, compared and sent: its canonical
        host form where it makes a host (service/config/tenants.py), else exactly as given."""
        return host_form(tenant_id) if self.tenant_in_host else tenant_id

    @cached_property
    def object_id_type(self) -> str | None:
        """The type a store target's statement casts its ids to (`CAST(:object_ids AS
        bigint[])`), None for any other policy: an id it cannot take is refused when it
        is registered or discovered, never left to fail its batch."""
        target = self.config.target
        return store_statements.ids_type(target.statement) if target is not None else None

    def object_id_problem(self, object_id: str) -> str | None:
        """Why this policy's target could never take `object_id`, or None."""
        kind = self.object_id_type
        return None if kind is None else store_statements.id_type_problem(kind, object_id)

    def object_id(self, object_id: str) -> str:
        """The object id as this policy's items are stored, compared and sent: lower-cased
        where the upstream treats ids case-insensitively (`object_id_case`)."""
        return object_id.lower() if self.config.object_id_case == "insensitive" else object_id

    def scope_for(self, tenant_id: str) -> str:
        """The limiter scope an item of this policy and tenant draws budget from."""
        return self.config.scope.format(
            tenant_id=tenant_id, upstream=self.target_name, policy=self.name
        )


@dataclass(frozen=True)
class Store:
    """A resolved store database: its config and the DSN read from the environment."""

    name: str
    config: StoreConfig
    dsn: str = field(repr=False)


@dataclass(frozen=True)
class WebhookSource:
    """A resolved webhook source with its secrets (several during rotation)."""

    name: str
    config: WebhookSourceConfig
    secrets: tuple[str, ...] = field(repr=False)


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
    check = _Resolution(env, source)
    parsed, written = _parse(raw, check.fail)
    check.names(written)
    upstreams, troubled = check.upstreams(parsed.upstreams)
    stores = check.stores(parsed.stores)
    policies: dict[str, Policy] = {}
    # every entry as written: one that does not fit the schema still has its names checked
    for name, entry in written["policies"].items():
        _reference_problems(f"policies.{name}", entry, written, check.fail)
        pol = parsed.policies.get(name)
        if pol is not None and (policy := check.policy(name, pol, upstreams)) is not None:
            policies[name] = policy
    webhooks: dict[str, WebhookSource] = {}
    for name, entry in written["webhooks"].items():
        _rule_references(f"webhooks.{name}", entry, written, check.fail)
        src = parsed.webhooks.get(name)
        if src is not None and (webhook := check.webhook(name, src)) is not None:
            webhooks[name] = webhook

    # what resolved: the entries without a problem, naming only entries that resolved
    upstreams = {name: upstream for name, upstream in upstreams.items() if name not in troubled}
    resolved: dict[str, Mapping[str, object]] = {"upstreams": upstreams, "stores": stores}
    policies = {name: policy for name, policy in policies.items()
                if all(named in resolved[section]
                       for _, section, named in _names(written["policies"][name]))}
    webhooks = {name: webhook for name, webhook in webhooks.items()
                if all(rule.policy in policies for rule in webhook.config.rules)}
    return Policies(upstreams=upstreams, policies=policies, webhooks=webhooks, source=source,
                    stores=stores), check.problems


class _Resolution:
    """One resolution of a parsed file: the environment its secrets come from, and every
    problem found, each naming the file and the key."""

    def __init__(self, env: Mapping[str, str], source: str) -> None:
        self.env = env
        self.source = source
        self.problems: list[str] = []

    def fail(self, key: str, message: str) -> None:
        self.problems.append(f"policies file {self.source}: {key}: {message}")

    def secret(self, var: str, key: str) -> str:
        """A secret from the environment, less one trailing line break, as a credential
        file's (a secret mounted from a file usually ends in one, and with it a header could
        not be sent, a signature never match, a DSN never parse)."""
        raw = str(self.env.get(var) or "")
        value = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
        if not raw:
            self.fail(key, f"environment variable {var} is not set")
        elif not value:
            self.fail(key, f"environment variable {var} holds only a line break")
        return value

    def header_secret(self, var: str, key: str) -> str:
        """A header's value from the environment: one that would make every call unsendable
        is refused here, never quoted."""
        value = self.secret(var, key)
        if not _HEADER_TEXT.fullmatch(value):
            self.fail(key, f"environment variable {var} holds a line break or a character a "
                           "header value cannot carry (visible ASCII, spaces and tabs)")
        return value

    def names(self, written: Mapping[str, Mapping[str, Any]]) -> None:
        for section, entries in written.items():
            for name in entries:
                if not re.match(NAME_PATTERN, name):
                    self.fail(f"{section}.{name}", "names are lower-case letters, digits, "
                                                   "'-', '_' or '.', at most 63 characters")

    def upstreams(self, declared: Mapping[str, UpstreamConfig]
                  ) -> tuple[dict[str, Upstream], set[str]]:
        """Each upstream that could be compiled, and those with problems: kept, so that
        their policies' own checks still run against them, but never resolved."""
        upstreams: dict[str, Upstream] = {}
        troubled: set[str] = set()
        for name, up in declared.items():
            found = len(self.problems)
            upstream = self.upstream(name, up)
            if len(self.problems) > found:
                troubled.add(name)
            if upstream is not None:
                upstreams[name] = upstream
        return upstreams, troubled

    def upstream(self, name: str, up: UpstreamConfig) -> Upstream | None:
        key = f"upstreams.{name}"
        headers = {header: self.header_secret(var, f"{key}.headers_from_env.{header}")
                   for header, var in up.headers_from_env.items()}
        templated = _header_templates(key, up, self.fail)
        headers.update({h: before for h, (before, after) in templated.items() if after is None})
        credential_headers = {h: (before, after) for h, (before, after) in templated.items()
                              if after is not None}
        origin: Origin | None = None
        try:
            origin = compile_origin(name, up.base_url, up.host_pattern,
                                    allow_private=up.allow_private_addresses)
        except TemplateProblems as exc:
            for sub, message in exc.problems:
                self.fail(f"{key}.{sub}", message)
        if up.proxy is not None and up.proxy != "none":
            try:
                Proxy.of(up.proxy)
            except ValueError as exc:
                self.fail(f"{key}.proxy", str(exc))
        try:
            tls = tls_context(up.ca_file, up.client_cert_file, up.client_key_file)
        except TlsProblem as exc:
            self.fail(f"{key}.{exc.key}", str(exc))
            return None
        if origin is None:
            return None
        return Upstream(name=name, config=up, headers=headers, origin=origin,
                        credential_headers=credential_headers, tls=tls)

    def stores(self, declared: Mapping[str, StoreConfig]) -> dict[str, Store]:
        """Each store whose DSN is set: one without is never connected to."""
        dsns = {name: self.secret(st.dsn_env, f"stores.{name}.dsn_env")
                for name, st in declared.items()}
        return {name: Store(name=name, config=declared[name], dsn=dsn)
                for name, dsn in dsns.items() if dsn}

    def policy(self, name: str, pol: PolicyConfig, upstreams: Mapping[str, Upstream]
               ) -> Policy | None:
        """The policy resolved, or None when it has a problem (each one listed)."""
        key, found = f"policies.{name}", len(self.problems)
        _store_problems(key, pol, self.fail)
        if pol.target is not None and pol.object_id_case == "insensitive":
            self.fail(f"{key}.object_id_case", "a store target's statement compares ids as "
                                               "its column does: \"insensitive\" is for HTTP "
                                               "upstreams")
        if pol.backoff.max_seconds < pol.backoff.base_seconds:
            self.fail(f"{key}.backoff.max_seconds", "must be at least base_seconds")
        listing = _listing(key, name, pol, upstreams, self.fail)
        if pol.target is not None:
            return (Policy(name=name, config=pol, request=None, **listing)
                    if len(self.problems) == found else None)
        _call_problems(key, pol, self.fail)
        if pol.upstream is None:
            self.fail(key, "name an upstream (and its path) to call, or a store target = { "
                           "store = ..., statement = ... }")
            return None
        upstream = upstreams.get(pol.upstream)
        if upstream is not None:
            _upstream_problems(key, pol, upstream, self.fail)
        if pol.path is None:
            self.fail(f"{key}.path", "required key is missing (the path the upstream is "
                                     "called at)")
        if upstream is None or pol.path is None:
            return None  # an unknown upstream is listed by _reference_problems
        requests = _requests(key, name, pol, upstream, pol.path, self.fail)
        if requests is None or len(self.problems) > found:
            return None
        request, confirm_request = requests
        return Policy(name=name, config=pol, request=request, confirm_request=confirm_request,
                      answers=compile_rules(
                          pol.answers, pol.answer_max_bytes,
                          actual_cost=pol.cost.actual if pol.cost else None,
                          available_cost=pol.cost.available if pol.cost else None,
                          failed_ids=pol.batch.failed if pol.batch else None),
                      **listing)

    def webhook(self, name: str, src: WebhookSourceConfig) -> WebhookSource | None:
        """The webhook source resolved, or None when it has a problem (each one listed)."""
        key, found = f"webhooks.{name}", len(self.problems)
        names = ([src.secret_env] if src.secret_env else []) + list(src.secrets_env)
        if not names:
            self.fail(key, "set secret_env (or secrets_env for rotation)")
        secrets = tuple(self.secret(var, f"{key}.secret_env") for var in names)
        if src.scheme == "hmac-sha256" and not src.signature_header:
            self.fail(f"{key}.signature_header", "required for scheme 'hmac-sha256'")
        for option in ("signature_header", "id_header", "topic_header"):
            if src.scheme != "hmac-sha256" and getattr(src, option) is not None:
                self.fail(f"{key}.{option}", f"only for scheme 'hmac-sha256' (scheme "
                                             f"{src.scheme!r} names its own headers)")
        if src.scheme == "standard":
            for var, value in zip(names, secrets, strict=True):
                if value and not _standard_secret_ok(value):
                    self.fail(f"{key}.secret_env", f"environment variable {var}: not a "
                                                   "Standard Webhooks secret ('whsec_' + "
                                                   "base64)")
        if len(self.problems) > found:
            return None
        return WebhookSource(name=name, config=src, secrets=secrets)


def _upstream_problems(key: str, pol: PolicyConfig, upstream: Upstream,
                       fail: Callable[[str, str], None]) -> None:
    """The checks of an HTTP policy against its upstream."""
    # The call's deadline must end before the lease does, or a slow upstream would let a
    # second worker reclaim an item whose first call is still in flight.
    if upstream.config.timeout_seconds >= pol.lease_seconds:
        fail(f"{key}.lease_seconds", f"must be longer than upstream {pol.upstream!r} "
                                     f"timeout_seconds ({upstream.config.timeout_seconds})")
    if upstream.per_tenant_credentials and "tenant_id" not in template_fields(pol.scope):
        # one tenant without a credential pauses its scope: never other tenants' items
        fail(f"{key}.scope", f"upstream {pol.upstream!r} has per-tenant credentials: the "
                             "scope must contain {tenant_id}")


SECTIONS: Final = ("upstreams", "stores", "policies", "webhooks")


def _parse(raw: Mapping[str, Any], fail: Callable[[str, str], None]
           ) -> tuple[PoliciesFile, dict[str, Mapping[str, Any]]]:
    """The entries that fit the schema, each validated on its own (one entry's mistakes
    never hide another's), and every entry as written, by section: another entry naming
    one that does not fit names no unknown one. Schema problems go to `fail`."""
    valid: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    written: dict[str, Mapping[str, Any]] = {section: {} for section in SECTIONS}
    for section, value in raw.items():
        parts = [value]
        if section in SECTIONS and isinstance(value, Mapping):
            written[section] = value
            parts = [{name: entry} for name, entry in value.items()]
        for part in parts:
            try:
                one = PoliciesFile.model_validate({section: part})
            except ValidationError as exc:
                for key, message in _schema_problems(exc):
                    fail(key, message)
            else:
                valid[section].update(getattr(one, section))
    # validated already: the models are taken as they are
    return PoliciesFile.model_validate(valid), written


def _names(entry: object) -> list[tuple[str, str, str]]:
    """The upstreams and stores a policy entry names, as written: (its key, the section,
    the name) each."""
    if not isinstance(entry, Mapping):
        return []
    named = [("upstream", "upstreams", entry.get("upstream"))]
    for part in ("source", "target", "guard"):
        cfg = entry.get(part)
        if isinstance(cfg, Mapping):
            # a source with an upstream is that upstream's list (policy_file._source_kind)
            named.append((f"{part}.upstream", "upstreams", cfg["upstream"])
                         if part == "source" and "upstream" in cfg
                         else (f"{part}.store", "stores", cfg.get("store")))
    return [(sub, section, name) for sub, section, name in named if isinstance(name, str)]


def _reference_problems(key: str, entry: object, written: Mapping[str, Mapping[str, Any]],
                        fail: Callable[[str, str], None]) -> None:
    """The upstreams and stores a policy names that the file does not declare, read from
    the entry as written: a policy with other mistakes still has its names checked."""
    for sub, section, name in _names(entry):
        if name not in written[section]:
            fail(f"{key}.{sub}", f"unknown {section[:-1]} {name!r}; declared: "
                                 f"{sorted(written[section]) or 'none'}")


def _rule_references(key: str, entry: object, written: Mapping[str, Mapping[str, Any]],
                     fail: Callable[[str, str], None]) -> None:
    """The policies a webhook source's rules name that the file does not declare."""
    rules = entry.get("rules") if isinstance(entry, Mapping) else None
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        policy = rule.get("policy") if isinstance(rule, Mapping) else None
        if isinstance(policy, str) and policy not in written["policies"]:
            fail(f"{key}.rules[{i}].policy", f"unknown policy {policy!r}")


def _call_problems(key: str, pol: PolicyConfig, fail: Callable[[str, str], None]) -> None:
    """The checks of an HTTP policy that need neither its upstream nor its path."""
    if pol.batch is not None and pol.confirm is not None:
        fail(f"{key}.confirm", "a confirmation reads one object, and a policy with "
                               "batch deletes many per call: not supported together "
                               "(drop batch to confirm its deletions)")
    if pol.batch is not None and not {"tenant_id", "policy"} <= template_fields(pol.scope):
        # a call is one scope's objects: one tenant's, sent with one policy's template
        fail(f"{key}.scope", "a policy with batch needs a scope holding {tenant_id} and "
                             "{policy}, e.g. \"{policy}:{tenant_id}\"")
    if pol.rate.unit == "rows":
        fail(f"{key}.rate.unit", "a budget in rows is for a store target's statement")
    elif (pol.rate.unit == "points") != (pol.cost is not None):
        fail(f"{key}.cost" if pol.cost is None else f"{key}.rate.unit",
             "a budget in points needs the cost of a call: cost = { requested = ... }"
             if pol.cost is None else "a call's cost counts against a budget in "
             "points: rate = { ..., unit = \"points\" }")
    elif pol.cost is not None and pol.cost.requested > pol.rate.burst:
        fail(f"{key}.cost.requested", f"a call costs more than the burst "
                                      f"({pol.rate.burst} points): no call could start")


def _requests(key: str, name: str, pol: PolicyConfig, upstream: Upstream, path: str,
              fail: Callable[[str, str], None]
              ) -> tuple[RequestTemplate, RequestTemplate | None] | None:
    """A policy's deletion call and its confirmation read compiled, or None when either
    cannot be (problems go to `fail`)."""
    request = None
    try:
        request = compile_request(upstream.origin, policy=name, version=pol.version,
                                  path=path, body=pol.body, batch=pol.batch is not None)
    except TemplateProblems as exc:
        for sub, message in exc.problems:
            fail(f"{key}.{sub}", message)
    for i, answer in enumerate(pol.answers):
        if request is not None and answer.version is not None and \
                not request.uses_object_version:
            fail(f"{key}.answers[{i}].version", "the request must carry "
                                                 "{object_version} for a retry to use it")
    confirm_request = None
    if pol.confirm is not None and pol.batch is None:
        try:
            confirm_request = compile_request(upstream.origin, policy=name,
                                              version=pol.version, path=pol.confirm.path)
        except TemplateProblems as exc:
            for sub, message in exc.problems:
                fail(f"{key}.confirm.{sub}", message)
            return None
    return None if request is None else (request, confirm_request)


_SOURCE_KINDS: Final = frozenset({"select", "with"})
_TARGET_KINDS: Final = frozenset({"delete", "update", "with"})
# what an HTTP call is made of: meaningless for a statement on a store
_HTTP_ONLY: Final = ("method", "body", "answers", "cost", "initial_object_version")


def _store_problems(key: str, pol: PolicyConfig, fail: Callable[[str, str], None]) -> None:
    """The checks of a policy's source, target and guard that the file alone can tell
    (`_reference_problems` the stores they name; service/sweeps/store_databases.py checks the rest
    against the store itself)."""
    if isinstance(pol.source, SourceConfig):
        for problem in store_statements.problems(pol.source.query, kinds=_SOURCE_KINDS,
                                          required=frozenset({"cutoff"}),
                                          allowed=frozenset({"cutoff"})):
            fail(f"{key}.source.query", problem)
    if pol.guard is not None and pol.guard.query is not None:
        for problem in store_statements.problems(pol.guard.query, kinds=_SOURCE_KINDS,
                                          required=frozenset(), allowed=frozenset()):
            fail(f"{key}.guard.query", problem)
    target = pol.target
    if target is None:
        if pol.guard is not None:
            fail(f"{key}.guard", "a guard yields a store target's deletions: this policy "
                                 "has no target")
        return
    for problem in store_statements.problems(target.statement, kinds=_TARGET_KINDS,
                                      required=frozenset({"object_ids", "cutoff"}),
                                      allowed=frozenset({"object_ids", "cutoff"}),
                                      returning=True):
        fail(f"{key}.target.statement", problem)
    if pol.upstream is not None or pol.path is not None:
        fail(f"{key}.upstream" if pol.upstream is not None else f"{key}.path",
             "a policy with a store target calls no upstream")
    for option in _HTTP_ONLY:
        if option in pol.model_fields_set:
            fail(f"{key}.{option}", "is for an upstream's HTTP call, not a store target")
    if pol.confirm is not None:
        fail(f"{key}.confirm", "a confirmation read is for an upstream's deletions, not "
                               "supported with a store target (its statement's RETURNING "
                               "already names the rows it deleted)")
    if pol.batch is not None and "policy" not in template_fields(pol.scope):
        # a statement is one policy's, and a token one statement of the scope's
        fail(f"{key}.scope", "a store target with batch needs a scope holding {policy}, "
                             "e.g. \"store:{upstream}:{policy}\" ({upstream} is the store)")
    if pol.batch is not None and pol.batch.failed is not None:
        fail(f"{key}.batch.failed", "is for an upstream's answer: a statement returns the "
                                    "rows it deleted")
    if pol.rate.unit not in ("calls", "rows"):
        fail(f"{key}.rate.unit", "a store target's budget counts calls (statements) or rows")
    # a statement past its timeout has ended before its lease does: no second worker runs
    # the same batch while the first still might
    longest = (target.lock_timeout_ms + target.statement_timeout_ms) / 1000
    if longest >= pol.lease_seconds:
        fail(f"{key}.lease_seconds", f"must be longer than the target's lock and statement "
                                     f"timeouts together ({longest:g} s)")


# Headers a call sets itself: a policies file never names them.
_CALL_HEADERS = frozenset({"host", "content-length", "content-type", "transfer-encoding",
                           "idempotency-key", "connection"})
# Text an HTTP header value may hold around a credential: visible ASCII, space and tab.
_HEADER_TEXT = re.compile(r"[\x20-\x7e\t]*")


def _header_templates(key: str, up: UpstreamConfig, fail: Callable[[str, str], None]
                      ) -> dict[str, tuple[str, str | None]]:
    """Each of `headers` as (text, None) when it is plain text, or (before, after) around
    its `{credential}`. Problems go to `fail(key, message)`."""
    out: dict[str, tuple[str, str | None]] = {}
    from_env = {h.lower() for h in up.headers_from_env}
    for header, value in up.headers.items():
        at = f"{key}.headers.{header}"
        if header.lower() in _CALL_HEADERS:
            fail(at, "is set by each call itself")
            continue
        if header.lower() in from_env:
            fail(at, "is also in headers_from_env: name a header once")
            continue
        try:
            pieces = parse_format(value)
        except ValueError as exc:
            fail(at, str(exc))
            continue
        names = [name for _, name in pieces if name is not None]
        if set(names) - {"credential"}:
            fail(at, "the one placeholder a header takes is {credential}")
            continue
        literals = [text for text, _ in pieces]
        if not all(_HEADER_TEXT.fullmatch(text) for text in literals):
            fail(at, "a header value is visible ASCII, spaces and tabs")
            continue
        if len(names) > 1:
            fail(at, "{credential} may appear once")
        elif names and up.credentials is None:
            fail(at, "{credential} needs the upstream's credentials (a directory or the API)")
        elif names:
            out[header] = (literals[0], "".join(literals[1:]))
        else:
            out[header] = ("".join(literals), None)
    if up.credentials is not None and not any(after is not None for _, after in out.values()):
        fail(f"{key}.credentials", "no header uses {credential}: add one, e.g. headers = "
                                   "{ Authorization = \"Bearer {credential}\" }")
    directory = up.credentials.directory if up.credentials is not None else None
    if directory is not None and not directory.is_dir():
        fail(f"{key}.credentials.directory", f"{directory} is not a directory")
    return out


def _standard_secret_ok(secret: str) -> bool:
    try:
        standard_key(secret)
    except ValueError:
        return False
    return True


def _schema_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """Each schema error as (key, message), the key in the file's own notation."""
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
        problems.append((key, message))
    return problems


def _listing(key: str, name: str, pol: PolicyConfig, upstreams: Mapping[str, Upstream],
             fail: Callable[[str, str], None]) -> dict[str, Any]:
    """A policy's HTTP list source compiled (`listing` and `list_answers` for its Policy),
    or nothing; problems go to `fail`. The list calls draw from the policy's scope of each
    tenant, so per-tenant credentials need a scope per tenant."""
    source = pol.source
    if not isinstance(source, ListSourceConfig):
        return {}
    at = f"{key}.source"
    try:
        older_than = parse_duration(source.older_than)
    except ValueError as exc:
        fail(f"{at}.older_than", str(exc))
        return {}
    upstream = upstreams.get(source.upstream)
    if upstream is None:  # unknown, or with problems of its own: both listed
        return {}
    if (upstream.per_tenant_credentials or len(source.tenants) > 1) and \
            "tenant_id" not in template_fields(pol.scope):
        # each tenant's list calls draw from, close and pause its own scope
        fail(f"{key}.scope", "a list source of several tenants (or with per-tenant "
                             "credentials) needs a scope holding {tenant_id}")
    try:
        request = compile_list_request(upstream.origin, source, policy=name,
                                       older_than=older_than)
    except TemplateProblems as exc:
        for sub, message in exc.problems:
            fail(f"{at}.{sub}", message)
        return {}
    return {"listing": request, "list_answers": compile_rules(source.answers,
                                                              source.max_bytes)}
