"""Settings from the environment, tokens, and log hygiene."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.config.settings import Environment, Settings, load_settings, plain_url
from service.config.tokens import Caller, Role, TokenSet, token_id
from service.errors import ConfigError
from service.observability.logs import ConsoleFormatter, JsonFormatter


def test_tokens_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_API_TOKENS", " aaaaaaaaaaaaaaaa , bbbbbbbbbbbbbbbb,")
    settings = Settings()
    assert [t.get_secret_value() for t in settings.api_tokens] == [
        "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"]
    assert "aaaa" not in repr(settings)


def test_short_token_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_API_TOKENS", "short")
    with pytest.raises(ValidationError, match="at least 16"):
        Settings()


def test_production_refuses_development_defaults() -> None:
    with pytest.raises(ValidationError, match="SWEEPER_API_TOKENS must be set"):
        Settings(environment=Environment.PRODUCTION)
    with pytest.raises(ValidationError, match="SWEEPER_DATABASE_URL must be set"):
        Settings(environment=Environment.PRODUCTION,
                 api_tokens="x" * 20)  # type: ignore[arg-type]


def test_every_refused_setting_and_broken_rule_at_once(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """Production with neither a token nor a database URL, a malformed port and a
    certificate without its key: every problem in one pass (they came one at a time: a
    rule between settings stopped at its first problem, and none was checked while a
    variable was refused). A rule reading a refused variable is not checked."""
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    monkeypatch.setenv("SWEEPER_ENVIRONMENT", "production")
    monkeypatch.setenv("SWEEPER_PORT", "eighty")
    monkeypatch.setenv("SWEEPER_TLS_CERT_FILE", str(cert))
    monkeypatch.setenv("SWEEPER_CREDENTIALS_PREVIOUS_KEYS", "not a key")
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert refused.value.problems == (
        "SWEEPER_PORT: Input should be a valid integer, unable to parse string as an integer",
        "SWEEPER_CREDENTIALS_PREVIOUS_KEYS: key 1 of 1: must be 32 random bytes in base64 "
        "(standard or URL-safe), such as `openssl rand -base64 32` prints",
        "SWEEPER_TLS_CERT_FILE and SWEEPER_TLS_KEY_FILE go together",
        "SWEEPER_API_TOKENS must be set in production (or SWEEPER_OPERATOR_TOKENS / "
        "SWEEPER_VIEWER_TOKENS)",
        "SWEEPER_DATABASE_URL must be set in production (the embedded database is for "
        "development)")


@pytest.mark.parametrize("url", ["mysql://x/y", "not a url at all"])
def test_database_url_must_be_postgres(url: str) -> None:
    with pytest.raises(ValidationError):
        Settings(database_url=url)  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "hosts", "plain"), [
    # the libpq form managed PostgreSQL services hand out, failover hosts in order
    ("postgresql://u:p%40w@h1:5432,h2:5433/db?target_session_attrs=read-write",
     ("h1:5432", "h2:5433"), "postgresql://u:p%40w@h1:5432,h2:5433/db"
                             "?target_session_attrs=read-write"),
    # a host without a port has libpq's: the `port` parameter, else 5432
    ("postgresql://u@h1,h2:6/db?port=6000&sslmode=require", ("h1:6000", "h2:6"),
     "postgresql://u@h1:6000,h2:6/db?sslmode=require"),
    ("postgresql://h1,h2/db", ("h1:5432", "h2:5432"), "postgresql://h1:5432,h2:5432/db"),
    # a socket directory, percent-encoded as libpq reads it
    ("postgresql://u@h1:5432,%2Frun%2Fpg/db", ("h1:5432", "/run/pg:5432"),
     "postgresql://u@h1:5432,%2Frun%2Fpg:5432/db"),
])
def test_a_url_of_several_hosts_is_read_as_libpq_reads_it(given: str, hosts: tuple[str, ...],
                                                          plain: str) -> None:
    """SQLAlchemy refused libpq's multi-host URL ("invalid literal for int()"): it is read
    into SQLAlchemy's form for the engine, and written back in libpq's for asyncpg's own
    connections (LISTEN, the webhook intake)."""
    url = Settings(database_url=given).sqlalchemy_url()  # type: ignore[arg-type]
    assert url is not None and url.query["host"] == hosts and url.host is None
    assert plain_url(url) == plain


@pytest.mark.parametrize(("url", "problem"), [
    ("postgresql://u@[::1]:5432,[::2]:5432/db", "not as IPv6 literals"),
    ("postgresql://u@h1,,h2/db", "an empty one in its list"),
])
def test_a_list_of_hosts_it_cannot_use_is_refused_by_name(url: str, problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        Settings(database_url=url)  # type: ignore[arg-type]


def test_sqlalchemy_url_uses_asyncpg() -> None:
    settings = Settings(database_url="postgresql://u:pw@db:5432/sweeper")  # type: ignore[arg-type]
    url = settings.sqlalchemy_url()
    assert url is not None and url.drivername == "postgresql+asyncpg"
    assert Settings().sqlalchemy_url() is None


def test_token_set_matches_any_configured_token() -> None:
    settings = Settings(api_tokens="a" * 16 + "," + "b" * 16)  # type: ignore[arg-type]
    tokens = TokenSet.of(settings.role_tokens())
    assert tokens.match("a" * 16) is not None
    assert tokens.match("b" * 16) is not None
    assert tokens.match("a" * 16) != tokens.match("b" * 16)
    assert tokens.match("c" * 16) is None
    assert tokens.match("") is None
    assert TokenSet.of(Settings().role_tokens()).match("a" * 16) is None


def test_each_setting_gives_its_tokens_a_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain SWEEPER_API_TOKENS entry keeps every right (admin): nothing breaks on
    upgrade; no part of a token is read as a role, even one spelt like a role prefix."""
    monkeypatch.setenv("SWEEPER_API_TOKENS", "admin-aaaaaaaaaaaaaaaa,viewer:bbbbbbbbbbbbbbbb")
    monkeypatch.setenv("SWEEPER_OPERATOR_TOKENS", "operator-cccccccccccccccc")
    monkeypatch.setenv("SWEEPER_VIEWER_TOKENS", " viewer-dddddddddddddddd ,")
    tokens = TokenSet.of(Settings().role_tokens())
    assert tokens.match("admin-aaaaaaaaaaaaaaaa") == Caller(
        token_id("admin-aaaaaaaaaaaaaaaa"), Role.ADMIN)
    assert tokens.match("viewer:bbbbbbbbbbbbbbbb") == Caller(
        token_id("viewer:bbbbbbbbbbbbbbbb"), Role.ADMIN)
    assert tokens.match("bbbbbbbbbbbbbbbb") is None
    assert tokens.match("operator-cccccccccccccccc").role is Role.OPERATOR  # type: ignore[union-attr]
    assert tokens.match("viewer-dddddddddddddddd").role is Role.VIEWER  # type: ignore[union-attr]
    assert tokens.by_id(token_id("viewer-dddddddddddddddd")) == Caller(
        token_id("viewer-dddddddddddddddd"), Role.VIEWER)
    assert tokens.by_id("token:00000000") is None


def test_a_token_under_two_roles_is_refused_without_quoting_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWEEPER_API_TOKENS", "both-roles-eeeeeeeeeeeeeeee")
    monkeypatch.setenv("SWEEPER_VIEWER_TOKENS", "both-roles-eeeeeeeeeeeeeeee")
    with pytest.raises(ValidationError, match="SWEEPER_API_TOKENS and SWEEPER_VIEWER_TOKENS"
                       ) as refused:
        Settings()
    assert "eeee" not in str(refused.value)
    monkeypatch.setenv("SWEEPER_VIEWER_TOKENS", "short")
    with pytest.raises(ValidationError, match="at least 16"):
        Settings()


def test_production_takes_tokens_of_any_role() -> None:
    settings = Settings(environment=Environment.PRODUCTION,
                        database_url="postgresql://u@db/sweeper",  # type: ignore[arg-type]
                        operator_tokens="o" * 16)  # type: ignore[arg-type]
    assert [role for _, role in settings.role_tokens()] == [Role.OPERATOR]


@pytest.mark.parametrize("formatter", [JsonFormatter(), ConsoleFormatter()])
def test_log_formatters_drop_secret_looking_fields(formatter: logging.Formatter) -> None:
    record = logging.LogRecord("x", logging.INFO, "f", 1, "claimed", (), None)
    record.item_id = 42
    record.api_token = "tok-SECRET"
    record.request_body = "card=4111"
    record.signature = "sig-SECRET"
    line = formatter.format(record)
    assert "42" in line
    assert "SECRET" not in line and "4111" not in line
    if isinstance(formatter, JsonFormatter):
        assert json.loads(line)["body"] == "claimed"
