"""The TOML policies file: upstreams, retention policies and webhook sources.

Parsed with stdlib ``tomllib`` and validated with pydantic (unknown keys are refused, so a
typo never silently falls back to a default). Secrets are never written in the file: it
names environment variables, which are resolved here, and a missing one is an error.
Problems raise one :class:`ConfigError` listing each (the file, the key and what is wrong),
so a file is fixed in one pass.
"""

from __future__ import annotations

import os
import re
import string
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from service import store_sql
from service.answers import (
    DEFAULT_MAX_BYTES,
    MAX_BODY_BYTES,
    NO_RULES,
    AnswerRule,
    AnswerRules,
    compile_rules,
    parse_path,
)
from service.errors import ConfigError
from service.list_config import ListRequest, ListSourceConfig, compile_list_request
from service.signatures import standard_key
from service.templates import (
    DOT_SEGMENTS,
    REQUEST_FIELDS,
    Origin,
    RequestTemplate,
    TemplateProblems,
    body_value,
    compile_origin,
    compile_request,
    parse_format,
)

SCOPE_FIELDS = frozenset({"tenant_id", "upstream", "policy"})
NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}$"

_DURATION = re.compile(
    r"^P(?:(?P<weeks>\d+)W)?(?:(?P<days>\d+)D)?"
    r"(?:T(?:(?P<hours>\d+)H)?(?:(?P<minutes>\d+)M)?(?:(?P<seconds>\d+(?:\.\d+)?)S)?)?$"
)


MAX_DURATION = timedelta(days=36_500)
# A scope's budget, from the policies file or the API: at least one call per 1,000 s (the
# bucket's arithmetic stays within double precision), at most 100,000 per second.
MIN_RATE_PER_SECOND = 0.001
MAX_RATE_PER_SECOND = 100_000


def parse_duration(text: str) -> timedelta:
    """Parse an ISO 8601 duration of weeks, days, hours, minutes and seconds (``P1DT2H``).

    Years and months are refused: their length depends on the calendar.
    """
    match = _DURATION.match(text)
    if match is None or text in {"P", "PT"} or text.endswith("T"):
        raise ValueError(f"{text!r} is not an ISO 8601 duration such as 'PT15M' or 'P1D'")
    parts = {k: float(v) for k, v in match.groupdict().items() if v is not None}
    try:
        duration = timedelta(**parts)
    except OverflowError:
        duration = timedelta.max
    if duration > MAX_DURATION:
        # a due time this far ahead would leave the range timestamps are stored in
        raise ValueError(f"{text!r} is longer than {MAX_DURATION.days} days")
    return duration


def template_fields(template: str) -> set[str]:
    """The ``{name}`` placeholders of a str.format template (refuses positional ones)."""
    names: set[str] = set()
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name or spec or conversion:
            raise ValueError(f"placeholder {{{name}}} must be a plain name like {{tenant_id}}")
        names.add(name)
    return names


HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,100}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CredentialsConfig(_Strict):
    """Where each tenant's credential for an upstream comes from: a directory holding one
    file per tenant (a Kubernetes Secret volume), or the write-only API
    (`PUT /v1/tenants/{tenant}/credentials/{upstream}`), stored encrypted."""

    directory: Path | None = None
    api: bool = False

    @model_validator(mode="after")
    def _one(self) -> CredentialsConfig:
        if (self.directory is not None) == self.api:
            raise ValueError("name exactly one source: directory = \"/path\" or api = true")
        return self


class UpstreamConfig(_Strict):
    """An HTTP deletion API and how to reach it. The base_url may hold placeholders in the
    host (then host_pattern, a regular expression every host must fully match, is required)
    and in the path: see service/templates.py. `headers` are sent with every call; their
    one placeholder is `{credential}`, the tenant's, from `credentials`."""

    base_url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
    host_pattern: str | None = Field(default=None, min_length=1, max_length=1000)
    headers_from_env: dict[str, str] = Field(default_factory=dict)
    headers: dict[HeaderName, Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=dict, max_length=20)
    credentials: CredentialsConfig | None = None
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_connections: int = Field(default=100, ge=1, le=10_000)

    @field_validator("base_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")


class RateConfig(_Strict):
    """The shared token bucket of a scope: sustained rate and burst, in calls, (with the
    policy's `cost`) in the upstream's cost points, or (with a store `target`) in rows."""

    per_second: float = Field(ge=MIN_RATE_PER_SECOND, le=MAX_RATE_PER_SECOND)
    burst: int = Field(default=1, ge=1, le=100_000)
    unit: Literal["calls", "points", "rows"] = "calls"


class CostConfig(_Strict):
    """What a call costs in points: `requested` is taken before it runs; `actual` and
    `available` are paths into the answer's JSON body (service/answers.py): the actual
    cost refunds the difference, the upstream's points left lower the shared bucket."""

    requested: float = Field(gt=0, le=1_000_000)
    actual: str | None = Field(default=None, min_length=1, max_length=500)
    available: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("actual", "available")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value


class BackoffConfig(_Strict):
    """Exponential backoff with full jitter for transient failures and 429s without a date."""

    base_seconds: float = Field(default=1.0, gt=0, le=3600)
    max_seconds: float = Field(default=900.0, gt=0, le=86_400)


MAX_OBJECTS_PER_CALL = 1000


class BatchConfig(_Strict):
    """Many objects of one scope per call: up to `max_objects`, named by {object_ids}.
    `failed`, a path into the answer's JSON body, lists the ids of objects the call did not
    delete (the others did); without it a call succeeds or fails as a whole."""

    max_objects: int = Field(ge=2, le=MAX_OBJECTS_PER_CALL)
    failed: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("failed")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value


EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
SqlText = Annotated[str, Field(min_length=1, max_length=store_sql.MAX_SQL_CHARS)]
# a table name in the store, optionally schema-qualified, as it is written unquoted
SqlName = Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]{0,62}(\.[a-z_][a-z0-9_]{0,62})?$")]


class StoreConfig(_Strict):
    """A PostgreSQL database of the store: its DSN is read from the environment (a read
    replica may serve a source: name another store for it). `ledger_table` is where the
    target records each batch it deleted, in the same transaction (docs/stores.md)."""

    dsn_env: EnvName
    max_connections: int = Field(default=4, ge=1, le=100)
    connect_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    ledger_table: SqlName = "cleanup_ledger"


class SourceConfig(_Strict):
    """Where a policy's candidates come from: a read-only query on a store with `:cutoff`,
    returning `tenant_id`, `object_id` and `age`, read a page at a time by keyset on
    (age, tenant_id, object_id), at most `rows_per_second`."""

    store: str
    query: SqlText
    page: int = Field(default=5000, ge=1, le=50_000)
    rows_per_second: float | None = Field(default=None, gt=0, le=10_000_000)
    statement_timeout_ms: int = Field(default=5000, ge=1, le=600_000)


def _source_kind(value: Any) -> str:
    """Which source a policy's `source` is: an upstream's list, or (by default) a store's
    query."""
    if isinstance(value, ListSourceConfig) or (isinstance(value, Mapping)
                                               and "upstream" in value):
        return "upstream"
    return "store"


# the tags pydantic puts in an error's key: dropped from the key a problem names
SOURCE_KINDS: Final = frozenset({"store", "upstream"})
AnySource = Annotated[Annotated[SourceConfig, Tag("store")]
                      | Annotated[ListSourceConfig, Tag("upstream")],
                      Discriminator(_source_kind)]


class TargetConfig(_Strict):
    """A statement deleting a batch of one scope's candidates on a store: it binds
    `:object_ids` (text[]) and `:cutoff`, re-checks the age predicate, and returns the
    `object_id` of each row it deleted."""

    store: str
    statement: SqlText
    lock_timeout_ms: int = Field(default=200, ge=1, le=60_000)
    statement_timeout_ms: int = Field(default=5000, ge=1, le=600_000)


class GuardConfig(_Strict):
    """Yield to shoppers: while a number read on the store is over `max`, the policy's
    scopes close for `backoff_seconds` (like a 429). The number is one of: a query's single
    value, the replay lag in seconds of the replica named `replica_lag`, or the count of
    other active backends (`active_backends = true`). Read at most once per `every_seconds`
    per process."""

    store: str
    query: SqlText | None = None
    replica_lag: str | None = Field(default=None, min_length=1, max_length=63)
    active_backends: bool = False
    max: float = Field(ge=0, le=1e12)
    backoff_seconds: float = Field(default=5.0, ge=0.1, le=3600)
    every_seconds: float = Field(default=1.0, ge=0.05, le=60)

    @model_validator(mode="after")
    def _one(self) -> GuardConfig:
        if sum((self.query is not None, self.replica_lag is not None,
                self.active_backends)) != 1:
            raise ValueError("name exactly one of query, replica_lag or active_backends")
        return self


class PolicyConfig(_Strict):
    """A versioned retention rule: what to call (an upstream's HTTP API, or a statement on a
    store's database), how fast, how to read the answer, and where candidates come from."""

    version: int = Field(ge=1)
    upstream: str | None = None
    method: Literal["DELETE", "POST", "PUT", "PATCH"] = "DELETE"
    path: str | None = None
    # where candidates are found: a store's query or an upstream's list (service/
    # list_config.py); and a statement on a store deleting them
    source: AnySource | None = None
    target: TargetConfig | None = None
    guard: GuardConfig | None = None
    # the JSON body: a TOML table or array, or JSON text; its strings are templates
    body: dict[str, Any] | list[Any] | None = None
    scope: str = "credential:{upstream}"
    rate: RateConfig
    cost: CostConfig | None = None
    batch: BatchConfig | None = None
    lease_seconds: int = Field(default=60, ge=5, le=86_400)
    max_attempts: int = Field(default=8, ge=1, le=1000)
    absent_means_deleted: bool = False
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    retry_after_max_seconds: float = Field(default=3600.0, gt=0, le=86_400)
    # how answers are read beyond their status: service/answers.py
    answers: list[AnswerRule] = Field(default_factory=list, max_length=100)
    answer_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1024, le=MAX_BODY_BYTES)
    # {object_version} until a conflict answer names the current one
    initial_object_version: str = Field(default="1", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")

    @field_validator("initial_object_version")
    @classmethod
    def _not_dots(cls, value: str) -> str:
        if value in DOT_SEGMENTS:
            raise ValueError("'.' and '..' are no version")
        return value

    @field_validator("path")
    @classmethod
    def _path_template(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        if "#" in value:
            raise ValueError("must not contain '#' (a fragment is never sent)")
        unknown = template_fields(value) - set(REQUEST_FIELDS)
        if unknown:
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; allowed: "
                             f"{sorted(REQUEST_FIELDS)}")
        return value

    @field_validator("body", mode="before")
    @classmethod
    def _body(cls, value: Any) -> Any:
        return body_value(value)

    @field_validator("scope")
    @classmethod
    def _scope_template(cls, value: str) -> str:
        unknown = template_fields(value) - SCOPE_FIELDS
        if unknown:
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; allowed: "
                             f"{sorted(SCOPE_FIELDS)}")
        return value


Extractor = Annotated[str, Field(pattern=r"^(header:[A-Za-z0-9-]+|body:[A-Za-z0-9_.\-\[\]]+)$")]

_PATH_STEP = re.compile(r"([A-Za-z0-9_\-]+)((?:\[\d{1,6}\])*)")


def parse_body_path(path: str) -> tuple[str | int, ...]:
    """The steps of a body path such as ``customer.id`` or ``line_items[0].id``: object keys
    (str) and list indices (int)."""
    steps: list[str | int] = []
    for segment in path.split("."):
        match = _PATH_STEP.fullmatch(segment)
        if match is None:
            raise ValueError(f"{path!r} is not a body path such as 'customer.id' or "
                             "'line_items[0].id'")
        steps.append(match.group(1))
        steps.extend(int(i) for i in re.findall(r"\d+", match.group(2)))
    return tuple(steps)


class WebhookRule(_Strict):
    """Maps one event type to an item hint."""

    topic: str = Field(min_length=1)
    policy: str
    tenant: Extractor
    object_id: Extractor
    due: str = "now"

    @field_validator("tenant", "object_id")
    @classmethod
    def _extractor(cls, value: str) -> str:
        if value.startswith("body:"):
            parse_body_path(value.removeprefix("body:"))
        return value

    @field_validator("due")
    @classmethod
    def _due(cls, value: str) -> str:
        if value != "now":
            parse_duration(value)
        return value


class WebhookSourceConfig(_Strict):
    """A storefront that sends signed hints."""

    scheme: Literal["standard", "shopify", "hmac-sha256"]
    secret_env: str | None = None
    secrets_env: list[str] = Field(default_factory=list)
    signature_header: HeaderName | None = None
    # hmac-sha256 only (the other schemes name these headers themselves): where the
    # webhook id (de-duplication) and the event type come from. Without id_header the
    # SHA-256 of the raw body is the id; without topic_header the body's "type" is the topic.
    id_header: HeaderName | None = None
    topic_header: HeaderName | None = None
    tolerance_seconds: int = Field(default=300, ge=1, le=86_400)
    max_body_bytes: int = Field(default=256 * 1024, ge=1024, le=16 * 1024 * 1024)
    rules: list[WebhookRule] = Field(default_factory=list)


class PoliciesFile(_Strict):
    """The whole file as written."""

    upstreams: dict[str, UpstreamConfig] = Field(default_factory=dict)
    stores: dict[str, StoreConfig] = Field(default_factory=dict)
    policies: dict[str, PolicyConfig] = Field(default_factory=dict)
    webhooks: dict[str, WebhookSourceConfig] = Field(default_factory=dict)


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

    @property
    def per_tenant_credentials(self) -> bool:
        return self.config.credentials is not None


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
        value = env.get(var)
        if not value:
            fail(key, f"environment variable {var} is not set")
        return str(value or "")

    for section in ("upstreams", "stores", "policies", "webhooks"):
        for name in getattr(parsed, section):
            if not re.match(NAME_PATTERN, name):
                fail(f"{section}.{name}", "names are lower-case letters, digits, '-', '_' "
                                          "or '.', at most 63 characters")

    upstreams: dict[str, Upstream] = {}
    for name, up in parsed.upstreams.items():
        headers = {header: secret(var, f"upstreams.{name}.headers_from_env.{header}")
                   for header, var in up.headers_from_env.items()}
        templated = _header_templates(f"upstreams.{name}", up, fail)
        headers.update({h: before for h, (before, after) in templated.items() if after is None})
        credential_headers = {h: (before, after) for h, (before, after) in templated.items()
                              if after is not None}
        try:
            origin = compile_origin(name, up.base_url, up.host_pattern)
        except TemplateProblems as exc:
            for sub, message in exc.problems:
                fail(f"upstreams.{name}.{sub}", message)
            continue
        upstreams[name] = Upstream(name=name, config=up, headers=headers, origin=origin,
                                   credential_headers=credential_headers)

    stores = {name: Store(name=name, config=st,
                          dsn=secret(st.dsn_env, f"stores.{name}.dsn_env"))
              for name, st in parsed.stores.items()}

    policies: dict[str, Policy] = {}
    for name, pol in parsed.policies.items():
        key = f"policies.{name}"
        _store_problems(key, pol, parsed.stores, fail)
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
        policies[name] = Policy(name=name, config=pol, request=request,
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
    (service/stores.py checks the rest against the store itself)."""
    for part in ("source", "target", "guard"):
        cfg = getattr(pol, part)
        if cfg is not None and not isinstance(cfg, ListSourceConfig) and \
                cfg.store not in stores:
            fail(f"{key}.{part}.store", f"unknown store {cfg.store!r}; declared: "
                                        f"{sorted(stores) or 'none'}")
    if isinstance(pol.source, SourceConfig):
        for problem in store_sql.problems(pol.source.query, kinds=_SOURCE_KINDS,
                                          required=frozenset({"cutoff"}),
                                          allowed=frozenset({"cutoff"})):
            fail(f"{key}.source.query", problem)
    if pol.guard is not None and pol.guard.query is not None:
        for problem in store_sql.problems(pol.guard.query, kinds=_SOURCE_KINDS,
                                          required=frozenset(), allowed=frozenset()):
            fail(f"{key}.guard.query", problem)
    target = pol.target
    if target is None:
        if pol.guard is not None:
            fail(f"{key}.guard", "a guard yields a store target's deletions: this policy "
                                 "has no target")
        return
    for problem in store_sql.problems(target.statement, kinds=_TARGET_KINDS,
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
