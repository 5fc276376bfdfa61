"""Process settings: one pydantic-settings object, built once in main and passed down.

Every field reads from an environment variable with the ``SWEEPER_`` prefix, e.g.
``SWEEPER_DATABASE_URL``. docs/configuration.md mirrors this class.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import ssl
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Final

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import NoDecode, SettingsConfigDict
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from service.config import signing_keys

# the URL helpers live with the URL forms; imported from here by most callers
from service.config.database_urls import async_url as async_url
from service.config.database_urls import plain_url as plain_url
from service.config.database_urls import sqlalchemy_hosts
from service.config.execution import ExecutionSettings
from service.config.tokens import ROLE_SETTINGS, Role, token_problems
from service.errors import ConfigError

ENV_PREFIX = "SWEEPER_"


class Environment(StrEnum):
    """Where the process runs; production refuses the conveniences of development."""

    DEVELOPMENT = "development"
    PRODUCTION = "production"


class LogFormat(StrEnum):
    """`auto` writes JSON unless stderr is a terminal."""

    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


class Settings(ExecutionSettings):
    """All process-level configuration. Policies live in the TOML file it names; the
    execution fields are ExecutionSettings'."""

    # An empty variable (`SWEEPER_POLICIES_FILE=`) means "not set", as in most shells' idiom.
    # No error shows the value it refused: several are secrets (tokens, keys, the URL's
    # password), and a ValidationError's text ends up in tracebacks.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True,
                                      env_ignore_empty=True, hide_input_in_errors=True)

    environment: Environment = Environment.DEVELOPMENT
    database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL URL; unset = start an embedded server under data_dir",
    )
    data_dir: Path = Field(default=Path(".sweeper"), description="embedded database and state")
    policies_file: Path | None = Field(default=None, description="TOML upstreams and policies")
    api_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="comma-separated bearer tokens accepted on /v1 with the admin role "
                    "(every right; what a token meant before roles)")
    operator_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="comma-separated bearer tokens with the operator role (runs, "
                    "registration, re-drive, cancel, pauses, budgets, and every read)")
    viewer_tokens: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="comma-separated bearer tokens with the viewer role (reads only)")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    workers: int = Field(default=4, ge=0, le=1024, description="concurrent claims per replica")
    batch_size: int = Field(default=500, ge=1, le=10_000, description="items per batch")
    db_pool_size: int = Field(default=10, ge=1, le=200)
    db_pool_timeout_seconds: float = Field(default=5.0, gt=0, le=120)
    db_statement_timeout_ms: int = Field(default=30_000, ge=100)
    webhook_max_in_flight: int = Field(
        default=64, ge=1, le=100_000,
        description="webhook deliveries one process handles at once; more get 503")
    webhook_db_pool_size: int = Field(
        default=8, ge=1, le=200,
        description="connections of the webhook intake's own pool (besides db_pool_size)")
    max_body_bytes: int = Field(
        default=10 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
        description="largest request body on the operator API (/v1 except webhooks, which "
                    "have their own per source); larger ones get 413 before they are read")
    body_read_timeout_seconds: float = Field(
        default=10.0, gt=0, le=600,
        description="a request body not received in full within this long gets 408")
    header_read_timeout_seconds: float = Field(
        default=10.0, gt=0, le=600,
        description="a connection that has not sent a request's headers within this long "
                    "is closed")
    max_connections: int = Field(
        default=1_000, ge=1, le=1_000_000,
        description="open connections plus requests in progress per process; "
                    "beyond it new requests get 503")
    console_session_seconds: int = Field(
        default=28_800, ge=300, le=7 * 86_400,
        description="how long a sign-in to the operator console (/console) lasts")
    console_secure_cookies: bool = Field(
        default=False,
        description="mark console cookies Secure on every request, not only those that "
                    "arrived over HTTPS (set it behind a proxy that terminates TLS from an "
                    "address outside FORWARDED_ALLOW_IPS)")
    migrate_on_start: bool = True
    shutdown_grace_seconds: float = Field(default=20.0, ge=0, le=600)
    retention_days: float = Field(
        default=30.0, ge=0, le=36_500,
        description="prune succeeded/cancelled items, webhook receipts and store targets' "
                    "ledger rows older than this (0: keep everything)")
    evidence_retention_days: float = Field(
        default=2_557, ge=0, le=36_500,
        description="keep deletion evidence this long after each deletion, past the "
                    "pruning of its item (default about 7 years; 0: keep none past the item)")
    evidence_signing_key_file: Path | None = Field(
        default=None,
        description="Ed25519 private key (PEM, or base64 of its 32 bytes) that signs each "
                    "run's evidence export; unset with the embedded database: one is made "
                    "under data_dir")
    evidence_signing_key: SecretStr | None = Field(
        default=None, description="the same key as text, instead of the file")
    evidence_previous_public_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated base64 public keys of earlier signing keys, still "
                    "published so exports signed before a rotation verify")
    retention_batch_size: int = Field(default=1_000, ge=1, le=100_000)
    retention_interval_seconds: float = Field(default=300.0, gt=0, le=86_400)
    metrics_port: int = Field(
        default=0, ge=0, le=65535,
        description="`sweeper worker` serves /metrics, /healthz and /readyz here (0: off); "
                    "`serve` uses its API port")
    tls_cert_file: Path | None = Field(default=None, description="serve HTTPS with this PEM")
    tls_key_file: Path | None = Field(default=None, description="private key of tls_cert_file")
    log_level: str = "INFO"
    log_format: LogFormat = LogFormat.AUTO
    credentials_key: SecretStr | None = Field(
        default=None,
        description="32 bytes, base64: encrypts tenants' upstream credentials stored through "
                    "the API (unset: the API refuses to store them)")
    credentials_previous_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="comma-separated earlier values of credentials_key: rows written under "
                    "them still open until `sweeper credentials rotate-key` moves them")

    @field_validator("api_tokens", "operator_tokens", "viewer_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @field_validator("api_tokens", "operator_tokens", "viewer_tokens")
    @classmethod
    def _tokens_long_enough(cls, tokens: list[SecretStr]) -> list[SecretStr]:
        for token in tokens:
            if len(token.get_secret_value()) < 16:
                raise ValueError("each API token must be at least 16 characters long")
        return tokens

    @field_validator("credentials_previous_keys", "evidence_previous_public_keys",
                     mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("credentials_key")
    @classmethod
    def _credentials_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        credential_key_bytes(value.get_secret_value())  # raises, naming no value
        return value

    @field_validator("credentials_previous_keys")
    @classmethod
    def _previous_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for n, key in enumerate(keys, 1):
            try:
                credential_key_bytes(key.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"key {n} of {len(keys)}: {exc}") from None
        return keys

    @field_validator("database_url")
    @classmethod
    def _parseable_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None
        raw = sqlalchemy_hosts(value.get_secret_value())  # its ValueError says what is wrong
        try:
            url = make_url(raw)
        except (ArgumentError, ValueError):
            raise ValueError("not a URL like postgresql://user@host:5432/db") from None
        if url.get_backend_name() != "postgresql":
            raise ValueError("only postgresql:// URLs are supported")
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("log_level must be DEBUG, INFO, WARNING or ERROR")
        return level

    @field_validator("tls_cert_file", "tls_key_file")
    @classmethod
    def _readable_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            try:
                with path.open("rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
        return path

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Every rule between settings, each broken one its own problem (all listed at once)."""
        errors = [InitErrorDetails(type=PydanticCustomError(rule, "{p}", {"p": problem}),
                                   loc=(), input=None)
                  for rule, (_, check) in RULES.items() for problem in check(self)]
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _tls_problems(self) -> list[str]:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            return ["SWEEPER_TLS_CERT_FILE and SWEEPER_TLS_KEY_FILE go together"]
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            # the same load uvicorn does at start, here so that a bad pair is refused by
            # check-config too; an encrypted key is refused rather than prompted for
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                context.load_cert_chain(self.tls_cert_file, self.tls_key_file,
                                        password=lambda: b"")
            except ssl.SSLError as exc:
                return [f"SWEEPER_TLS_CERT_FILE {self.tls_cert_file} and SWEEPER_TLS_KEY_FILE "
                        f"{self.tls_key_file}: not a PEM certificate and its unencrypted "
                        f"private key ({exc.reason or exc})"]
        return []

    @field_validator("evidence_previous_public_keys")
    @classmethod
    def _public_keys(cls, keys: list[str]) -> list[str]:
        for n, key in enumerate(keys, 1):
            try:
                signing_keys.public_keys(key.encode())
            except signing_keys.KeyProblem as exc:
                raise ValueError(f"key {n} of {len(keys)}: {exc}") from None
        return keys

    def _evidence_key_problems(self) -> list[str]:
        if self.evidence_signing_key is not None and self.evidence_signing_key_file is not None:
            return ["set SWEEPER_EVIDENCE_SIGNING_KEY or SWEEPER_EVIDENCE_SIGNING_KEY_FILE, "
                    "not both"]
        try:
            self.evidence_signer()
        except ValueError as exc:  # it names the setting and never the key
            return [str(exc)]
        return []

    def _previous_public_keys(self) -> tuple[signing_keys.PublicKey, ...]:
        return tuple(k for text in self.evidence_previous_public_keys
                     for k in signing_keys.public_keys(text.encode()))

    def evidence_signer(self) -> signing_keys.Signer | None:
        """The configured evidence signing key with the earlier public keys, or None (the
        process makes a local key for the embedded database: `local_evidence_signer`)."""
        try:
            if self.evidence_signing_key is not None:
                source = "SWEEPER_EVIDENCE_SIGNING_KEY"
                secret = self.evidence_signing_key.get_secret_value()
                key = signing_keys.private_key(secret.encode())
            elif self.evidence_signing_key_file is not None:
                source = f"SWEEPER_EVIDENCE_SIGNING_KEY_FILE {self.evidence_signing_key_file}"
                key = signing_keys.private_key(self.evidence_signing_key_file.read_bytes())
            else:
                return None
        except OSError as exc:
            raise ValueError(f"{source}: cannot be read ({exc.strerror})") from None
        except signing_keys.KeyProblem as exc:
            raise ValueError(f"{source}: {exc}") from None
        return signing_keys.Signer(key, self._previous_public_keys())

    def local_evidence_signer(self) -> signing_keys.Signer | None:
        """`evidence_signer`, or with none configured and the embedded database (no
        database URL: local use), a key kept under data_dir, made on first use."""
        signer = self.evidence_signer()
        if signer is None and self.database_url is None:
            signer = signing_keys.Signer(signing_keys.local_key(self.data_dir),
                                         self._previous_public_keys())
        return signer

    def _credential_key_problems(self) -> list[str]:
        if self.credentials_previous_keys and self.credentials_key is None:
            return ["SWEEPER_CREDENTIALS_PREVIOUS_KEYS needs SWEEPER_CREDENTIALS_KEY: every "
                    "write uses the current key"]
        return []

    def role_tokens(self) -> list[tuple[str, Role]]:
        """Every configured token with the role its setting gives it."""
        return [(token.get_secret_value(), role) for role, name in ROLE_SETTINGS.items()
                for token in getattr(self, name)]

    def _production_problems(self) -> list[str]:
        production = self.environment is Environment.PRODUCTION
        return [problem for problem, missing in (
            ("SWEEPER_API_TOKENS must be set in production (or SWEEPER_OPERATOR_TOKENS / "
             "SWEEPER_VIEWER_TOKENS)", not self.role_tokens()),
            ("SWEEPER_DATABASE_URL must be set in production (the embedded database is for "
             "development)", self.database_url is None)) if production and missing]

    def credential_keys(self) -> list[bytes]:
        """The credential encryption keys, the current one first; empty when unset."""
        if self.credentials_key is None:
            return []
        return [credential_key_bytes(k.get_secret_value())
                for k in (self.credentials_key, *self.credentials_previous_keys)]

    def sqlalchemy_url(self) -> URL | None:
        """The configured URL with the asyncpg driver, or None for the embedded server."""
        if self.database_url is None:
            return None
        return async_url(self.database_url.get_secret_value())


# The rules between settings, by name (the type of the error each raises): the fields each
# reads, and its check (a problem per line, none when it holds).
_TOKENS = frozenset(ROLE_SETTINGS.values())
RULES: Final[dict[str, tuple[frozenset[str], Callable[[Settings], list[str]]]]] = {
    "tls_pair": (frozenset({"tls_cert_file", "tls_key_file"}), Settings._tls_problems),
    "evidence_key": (frozenset({"evidence_signing_key", "evidence_signing_key_file",
                                "evidence_previous_public_keys"}),
                     Settings._evidence_key_problems),
    "credential_keys": (frozenset({"credentials_key", "credentials_previous_keys"}),
                        Settings._credential_key_problems),
    "one_role_per_token": (_TOKENS, lambda settings: token_problems(settings.role_tokens())),
    "production": (_TOKENS | {"environment", "database_url"}, Settings._production_problems),
    "execution": (frozenset({"execution", "broker_url"}), Settings._execution_problems),
}


CREDENTIAL_KEY_BYTES = 32  # AES-256


def credential_key_bytes(text: str) -> bytes:
    """A credential key from its base64 text, standard or URL-safe alphabet, padded or not.
    The error never quotes the text: it is a secret."""
    raw = text.strip().replace("-", "+").replace("_", "/")
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != CREDENTIAL_KEY_BYTES:
        raise ValueError(f"must be {CREDENTIAL_KEY_BYTES} random bytes in base64 (standard or "
                         "URL-safe), such as `openssl rand -base64 32` prints")
    return key


# SWEEPER_* variables read by commands and tools rather than by Settings.
OTHER_VARIABLES: Mapping[str, str] = {
    "SWEEPER_URL": "the server `sweeper run` calls",
    "SWEEPER_TOKEN": "the bearer token `sweeper run` sends",
    "SWEEPER_TEST_DATABASE_URL": "the test suite's PostgreSQL server",
    "SWEEPER_REQUIRE_TOOLS": "the test suite fails rather than skips without its tools",
    "SWEEPER_BENCH_DATABASE_URL": "the benchmarks' PostgreSQL server",
    "SWEEPER_BENCH_AMQP_URL": "the RabbitMQ `bench peers` drains Celery tasks on",
}
OTHER_PREFIXES = ("SWEEPER_DRILL_",)  # faults of a drill's own processes


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per SWEEPER_* variable nothing reads (a misspelt setting is otherwise
    silently ignored), with the closest known name when one is near."""
    known = [*(ENV_PREFIX + name.upper() for name in Settings.model_fields), *OTHER_VARIABLES]
    warnings = []
    for name in sorted(environ):
        if (not name.startswith(ENV_PREFIX) or name in known
                or name.startswith(OTHER_PREFIXES)):
            continue
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]}?)" if near else ""
        warnings.append(f"{name} is not a setting Sweeper knows; it is ignored{hint}")
    return warnings


def settings_problems(exc: ValidationError) -> list[str]:
    """Each of pydantic's errors as one line naming the variable."""
    problems = []
    for err in exc.errors(include_input=False, include_url=False):
        field = ".".join(str(p) for p in err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        problems.append(f"{ENV_PREFIX}{field.upper()}: {message}" if field else message)
    return problems


def load_settings() -> Settings:
    """Settings from the environment; ConfigError listing every problem (`read_settings`)."""
    settings, problems = read_settings()
    if problems or settings is None:
        raise ConfigError(*problems)
    return settings


def read_settings() -> tuple[Settings | None, list[str]]:
    """Settings from the environment, and every problem: each variable's, and each broken
    rule between settings reading no refused variable. With problems, the settings are for
    checking the rest (check-config), never for running: those variables at defaults."""
    try:
        return Settings(), []
    except ValidationError as exc:
        refused = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
        problems = settings_problems(exc)
    # pydantic checks rules once every field is valid: with the refused ones at defaults,
    # then those of each broken rule too (but the URL: its rule holds in development)
    reset = set(refused)
    for _ in range(len(RULES) + 1):
        defaults = {name: Settings.model_fields[name].get_default(call_default_factory=True)
                    for name in reset}
        try:
            return Settings(**defaults), problems
        except ValidationError as exc:
            broken = [(RULES[str(err["type"])][0], line) for err, line in zip(
                exc.errors(include_input=False), settings_problems(exc), strict=True)]
        if reset == refused:  # the rules reading no refused variable: broken as they are
            problems += [line for reads, line in broken if refused and not reads & refused]
        more = {name for reads, _ in broken for name in reads} - reset - {"database_url"}
        if not more:
            return None, problems
        reset |= more
    return None, problems
