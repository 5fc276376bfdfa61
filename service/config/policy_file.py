"""The policies file as written: every key it may hold, its type, bounds and default.

pydantic models that refuse unknown keys (a typo never silently falls back to a default),
so a file that parses here has the right shape; names, secrets and what keys mean together
are checked when `service.config.policies` resolves it.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from service.config import store_statements
from service.config.answer_rules import DEFAULT_MAX_BYTES, MAX_BODY_BYTES, AnswerRule
from service.config.body_templates import body_value
from service.config.list_sources import ListSourceConfig
from service.config.placeholders import DOT_SEGMENTS, REQUEST_FIELDS, template_fields
from service.config.policy_tables import (
    BackoffConfig,
    BatchConfig,
    ConfirmConfig,
    CostConfig,
    TracingConfig,
)
from service.config.regions import MAX_TENANTS_PER_REGION

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


MAX_SCOPE_BYTES: Final = 512  # the schema's limit on a limiter scope's name
# C0 and C1 control characters and DEL (the schema's CHECKs refuse the same), and unpaired
# surrogates, which are no text PostgreSQL (or UTF-8) can hold: in an id, a scope's name
UNSTORABLE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


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
    and in the path: see service/config/request_templates.py. `headers` are sent with every call;
    their one placeholder is `{credential}`, the tenant's, from `credentials`. A templated host
    names no internal address unless `allow_private_addresses`."""

    base_url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")]
    host_pattern: str | None = Field(default=None, min_length=1, max_length=1000)
    headers_from_env: dict[str, str] = Field(default_factory=dict)
    headers: dict[HeaderName, Annotated[str, Field(max_length=1000)]] = Field(
        default_factory=dict, max_length=20)
    credentials: CredentialsConfig | None = None
    timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    max_connections: int = Field(default=100, ge=1, le=10_000)
    # at most this many of them to one host (a tenant's, where the host is built from its
    # id); absent: max_connections
    max_connections_per_host: int | None = Field(default=None, ge=1, le=10_000)
    # false: one request per connection, each saying `Connection: close` (an upstream whose
    # kept-alive connections cannot be trusted to answer only what was asked)
    keep_alive: bool = True
    # a header the upstream echoes: each call sends a fresh value in it, and an answer that
    # could mean "deleted" (2xx, 404, 410) counts only when it carries that same value
    echo_header: HeaderName | None = None
    # a templated host may be an IP literal or a single-label name, and may resolve to a
    # loopback, private or link-local address (service/protocols/egress.py checks what it resolves
    # to): for tests and in-cluster services only
    allow_private_addresses: bool = False
    # "http://[user:password@]proxy:port", or "none"; absent: HTTPS_PROXY / HTTP_PROXY /
    # NO_PROXY from the environment
    proxy: str | None = Field(default=None, pattern=r"^(none|http://\S+)$", max_length=1000)
    # TLS: the CA bundle that verifies the upstream (absent: the public roots, or
    # SSL_CERT_FILE), and a client certificate and key for mutual TLS (both or neither)
    ca_file: Path | None = None
    client_cert_file: Path | None = None
    client_key_file: Path | None = None

    @model_validator(mode="after")
    def _client_pair(self) -> UpstreamConfig:
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("give client_cert_file and client_key_file together")
        return self

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


EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
SqlText = Annotated[str, Field(min_length=1, max_length=store_statements.MAX_SQL_CHARS)]
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
    # "insensitive": the upstream does not tell `ABC` from `abc`, so object ids are stored,
    # compared and sent lower-cased (one object, one operation key, one hold)
    object_id_case: Literal["exact", "insensitive"] = "exact"
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
    # how answers are read beyond their status: service/config/answer_rules.py
    answers: list[AnswerRule] = Field(default_factory=list, max_length=100)
    answer_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1024, le=MAX_BODY_BYTES)
    # {object_version} until a conflict answer names the current one
    initial_object_version: str = Field(default="1", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    # a read that must find the object gone before the item is `succeeded`
    confirm: ConfirmConfig | None = None
    tracing: TracingConfig = Field(default_factory=TracingConfig)

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
        # what the ledger's CHECK on a scope's name allows, known before any item is
        # registered (a tenant id that makes it too long is refused per item,
        # ledger/registration.py)
        literal = "".join(text for text, *_ in string.Formatter().parse(value))
        if not value:
            raise ValueError('must name the token bucket, e.g. "tenant:{tenant_id}"')
        if UNSTORABLE.search(literal):  # first: a surrogate cannot be encoded to be measured
            raise ValueError("must not hold control characters or unpaired surrogates")
        if len(literal.encode()) >= MAX_SCOPE_BYTES:
            raise ValueError(f"its text is over the {MAX_SCOPE_BYTES} bytes a scope may be")
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

    scheme: Literal["standard", "shopify", "hmac-sha256", "header"]
    secret_env: str | None = None
    secrets_env: list[str] = Field(default_factory=list)
    # hmac-sha256: the header holding the body's HMAC; header: the one holding the secret
    signature_header: HeaderName | None = None
    # hmac-sha256 and header only (the other schemes name these themselves): where the
    # webhook id (de-duplication) and the event type come from. Without id_header the
    # SHA-256 of the raw body is the id; without topic_header the event type is the body's
    # `topic_path` ("type" unless set; BigCommerce's is "scope").
    id_header: HeaderName | None = None
    topic_header: HeaderName | None = None
    topic_path: str | None = Field(default=None, min_length=1, max_length=200)
    tolerance_seconds: int = Field(default=300, ge=1, le=86_400)
    max_body_bytes: int = Field(default=256 * 1024, ge=1024, le=16 * 1024 * 1024)
    rules: list[WebhookRule] = Field(default_factory=list)

    @field_validator("topic_path")
    @classmethod
    def _topic_path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_body_path(value)
        return value


class PoliciesFile(_Strict):
    """The whole file as written."""

    upstreams: dict[str, UpstreamConfig] = Field(default_factory=dict)
    stores: dict[str, StoreConfig] = Field(default_factory=dict)
    policies: dict[str, PolicyConfig] = Field(default_factory=dict)
    webhooks: dict[str, WebhookSourceConfig] = Field(default_factory=dict)
    # region -> tenant ids pinned to it (service/config/regions.py checks both)
    regions: dict[str, Annotated[list[str], Field(max_length=MAX_TENANTS_PER_REGION)]] = Field(
        default_factory=dict, max_length=64)
