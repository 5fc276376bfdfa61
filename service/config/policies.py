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
from service.config.origins import Origin, compile_origin
from service.config.placeholders import TemplateProblems, parse_format, template_fields
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
)
from service.config.request_templates import RequestTemplate, compile_request
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
        checks the addresses it connects to; service/config/origins.py the host's
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

    problems: list[str] = []

    def fail(key: str, message: str) -> None:
        problems.append(f"policies file {source}: {key}: {message}")

    def secret(var: str, key: str) -> str:
        """A secret from the environment, less one trailing line break, as a credential
        file's (a secret mounted from a file usually ends in one, and with it a header could
        not be sent, a signature never match, a DSN never parse)."""
        raw = str(env.get(var) or "")
        value = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
        if not raw:
            fail(key, f"environment variable {var} is not set")
        elif not value:
            fail(key, f"environment variable {var} holds only a line break")
        return value

    for section in ("upstreams", "stores", "policies", "webhooks"):
        for name in getattr(parsed, section):
            if not re.match(NAME_PATTERN, name):
                fail(f"{section}.{name}", "names are lower-case letters, digits, '-', '_' "
                                          "or '.', at most 63 characters")

    def header_secret(var: str, key: str) -> str:
        """A header's value from the environment: one that would make every call unsendable
        is refused here, never quoted."""
        value = secret(var, key)
        if not _HEADER_TEXT.fullmatch(value):
            fail(key, f"environment variable {var} holds a line break or a character a "
                      "header value cannot carry (visible ASCII, spaces and tabs)")
        return value

    upstreams: dict[str, Upstream] = {}
    for name, up in parsed.upstreams.items():
        headers = {header: header_secret(var, f"upstreams.{name}.headers_from_env.{header}")
                   for header, var in up.headers_from_env.items()}
        templated = _header_templates(f"upstreams.{name}", up, fail)
        headers.update({h: before for h, (before, after) in templated.items() if after is None})
        credential_headers = {h: (before, after) for h, (before, after) in templated.items()
                              if after is not None}
        try:
            origin = compile_origin(name, up.base_url, up.host_pattern,
                                    allow_private=up.allow_private_addresses)
        except TemplateProblems as exc:
            for sub, message in exc.problems:
                fail(f"upstreams.{name}.{sub}", message)
            continue
        if up.proxy is not None and up.proxy != "none":
            try:
                Proxy.of(up.proxy)
            except ValueError as exc:
                fail(f"upstreams.{name}.proxy", str(exc))
        try:
            tls = tls_context(up.ca_file, up.client_cert_file, up.client_key_file)
        except TlsProblem as exc:
            fail(f"upstreams.{name}.{exc.key}", str(exc))
            continue
        upstreams[name] = Upstream(name=name, config=up, headers=headers, origin=origin,
                                   credential_headers=credential_headers, tls=tls)

    stores = {name: Store(name=name, config=st,
                          dsn=secret(st.dsn_env, f"stores.{name}.dsn_env"))
              for name, st in parsed.stores.items()}

    policies: dict[str, Policy] = {}
    for name, pol in parsed.policies.items():
        key = f"policies.{name}"
        _store_problems(key, pol, parsed.stores, fail)
        if pol.target is not None and pol.object_id_case == "insensitive":
            fail(f"{key}.object_id_case", "a store target's statement compares ids as its "
                                          "column does: \"insensitive\" is for HTTP upstreams")
        if pol.backoff.max_seconds < pol.backoff.base_seconds:
            fail(f"{key}.backoff.max_seconds", "must be at least base_seconds")
        listing = _listing(key, name, pol, upstreams, parsed.upstreams, fail)
        if pol.target is not None:
            if not any(f"{key}.{sub}" in p for p in problems for sub in ("target", "upstream",
                                                                         "source")):
                policies[name] = Policy(name=name, config=pol, request=None, **listing)
            continue
        upstream = upstreams.get(pol.upstream) if pol.upstream is not None else None
        if pol.upstream is None:
            fail(key, "name an upstream (and its path) to call, or a store target = { store "
                      "= ..., statement = ... }")
            continue
        if pol.path is None:
            fail(f"{key}.path", "required key is missing (the path the upstream is called "
                                "at)")
            continue
        if upstream is None:
            if pol.upstream not in parsed.upstreams:  # else its own problem is listed
                fail(f"{key}.upstream", f"unknown upstream {pol.upstream!r}; declared: "
                                        f"{sorted(parsed.upstreams) or 'none'}")
        # The call's deadline must end before the lease does, or a slow upstream would let a
        # second worker reclaim an item whose first call is still in flight.
        elif upstream.config.timeout_seconds >= pol.lease_seconds:
            fail(f"{key}.lease_seconds", f"must be longer than upstream {pol.upstream!r} "
                                         f"timeout_seconds ({upstream.config.timeout_seconds})")
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
        if upstream is not None and upstream.per_tenant_credentials and (
                "tenant_id" not in template_fields(pol.scope)):
            # one tenant without a credential pauses its scope: never other tenants' items
            fail(f"{key}.scope", f"upstream {pol.upstream!r} has per-tenant credentials: the "
                                 "scope must contain {tenant_id}")
        if upstream is None:
            continue
        try:
            request = compile_request(upstream.origin, policy=name, version=pol.version,
                                      path=pol.path, body=pol.body,
                                      batch=pol.batch is not None)
        except TemplateProblems as exc:
            for sub, message in exc.problems:
                fail(f"{key}.{sub}", message)
            continue
        for i, answer in enumerate(pol.answers):
            if answer.version is not None and not request.uses_object_version:
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
                continue
        policies[name] = Policy(name=name, config=pol, request=request,
                                confirm_request=confirm_request,
                                answers=compile_rules(
                                    pol.answers, pol.answer_max_bytes,
                                    actual_cost=pol.cost.actual if pol.cost else None,
                                    available_cost=pol.cost.available if pol.cost else None,
                                    failed_ids=pol.batch.failed if pol.batch else None),
                                **listing)

    webhooks: dict[str, WebhookSource] = {}
    for name, src in parsed.webhooks.items():
        key = f"webhooks.{name}"
        names = ([src.secret_env] if src.secret_env else []) + list(src.secrets_env)
        if not names:
            fail(key, "set secret_env (or secrets_env for rotation)")
        secrets = tuple(secret(var, f"{key}.secret_env") for var in names)
        if src.scheme == "hmac-sha256" and not src.signature_header:
            fail(f"{key}.signature_header", "required for scheme 'hmac-sha256'")
        for option in ("signature_header", "id_header", "topic_header"):
            if src.scheme != "hmac-sha256" and getattr(src, option) is not None:
                fail(f"{key}.{option}", f"only for scheme 'hmac-sha256' (scheme "
                                        f"{src.scheme!r} names its own headers)")
        if src.scheme == "standard":
            for var, value in zip(names, secrets, strict=True):
                if value and not _standard_secret_ok(value):
                    fail(f"{key}.secret_env", f"environment variable {var}: not a "
                                              "Standard Webhooks secret ('whsec_' + base64)")
        for i, rule in enumerate(src.rules):
            if rule.policy not in parsed.policies:
                fail(f"{key}.rules[{i}].policy", f"unknown policy {rule.policy!r}")
        webhooks[name] = WebhookSource(name=name, config=src, secrets=secrets)

    if problems:
        raise ConfigError(*problems)
    return Policies(upstreams=upstreams, policies=policies, webhooks=webhooks, source=source,
                    stores=stores)


_SOURCE_KINDS: Final = frozenset({"select", "with"})
_TARGET_KINDS: Final = frozenset({"delete", "update", "with"})
# what an HTTP call is made of: meaningless for a statement on a store
_HTTP_ONLY: Final = ("method", "body", "answers", "cost", "initial_object_version")


def _store_problems(key: str, pol: PolicyConfig, stores: Mapping[str, StoreConfig],
                    fail: Callable[[str, str], None]) -> None:
    """The checks of a policy's source, target and guard that the file alone can tell
    (service/sweeps/store_databases.py checks the rest against the store itself)."""
    for part in ("source", "target", "guard"):
        cfg = getattr(pol, part)
        if cfg is not None and not isinstance(cfg, ListSourceConfig) and \
                cfg.store not in stores:
            fail(f"{key}.{part}.store", f"unknown store {cfg.store!r}; declared: "
                                        f"{sorted(stores) or 'none'}")
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


def _listing(key: str, name: str, pol: PolicyConfig, upstreams: Mapping[str, Upstream],
             declared: Mapping[str, UpstreamConfig], fail: Callable[[str, str], None]
             ) -> dict[str, Any]:
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
    if upstream is None:
        if source.upstream not in declared:  # else its own problem is listed
            fail(f"{at}.upstream", f"unknown upstream {source.upstream!r}; declared: "
                                   f"{sorted(declared) or 'none'}")
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
