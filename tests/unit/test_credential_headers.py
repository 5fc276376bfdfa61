"""An upstream's per-tenant credentials in the policies file: `credentials` names the source,
`headers` carry `{credential}`; what cannot work is refused at start-up with its key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.budget.credential_waits import missing_key
from service.config.policies import resolve_policies
from service.credentials.crypto import Keyring
from service.errors import ConfigError


def doc(tmp_path: Path, scope: str = "shop:{tenant_id}", **upstream: Any) -> dict[str, Any]:
    up: dict[str, Any] = {"base_url": "https://api.example.com",
                          "credentials": {"directory": str(tmp_path)},
                          "headers": {"Authorization": "Bearer {credential}"}}
    up.update(upstream)
    return {"upstreams": {"api": {k: v for k, v in up.items() if v is not None}},
            "policies": {"p": {"version": 1, "upstream": "api", "path": "/c/{object_id}",
                               "scope": scope, "rate": {"per_second": 1}}}}


def problems(document: dict[str, Any], env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        resolve_policies(document, env or {}, source="f.toml")
    return [p.removeprefix("policies file f.toml: ") for p in refused.value.problems]


def test_a_credential_header_is_split_around_the_credential(tmp_path: Path) -> None:
    policies = resolve_policies(doc(tmp_path, headers={
        "Authorization": "Bearer {credential}", "X-Api-Version": "2025-10"}), {},
        source="f.toml")
    up = policies.upstreams["api"]
    assert up.credential_headers == {"Authorization": ("Bearer ", "")}
    assert up.headers == {"X-Api-Version": "2025-10"}  # plain text is a fixed header
    assert up.per_tenant_credentials


@pytest.mark.parametrize(("upstream", "expected"), [
    ({"headers": {"Authorization": "Bearer {token}"}},
     "upstreams.api.headers.Authorization: the one placeholder a header takes is {credential}"),
    ({"headers": {"X-A": "{credential}{credential}"}},
     "upstreams.api.headers.X-A: {credential} may appear once"),
    ({"headers": {"X-A": "{credential}\r\nX-Evil: 1"}},
     "upstreams.api.headers.X-A: a header value is visible ASCII, spaces and tabs"),
    ({"headers": {"Idempotency-Key": "{credential}"}},
     "upstreams.api.headers.Idempotency-Key: is set by each call itself"),
    ({"headers": {"Host": "{credential}"}}, "upstreams.api.headers.Host: is set by each call"),
    ({"headers": {"X-A": "{credential}"}, "headers_from_env": {"x-a": "V"}},
     "upstreams.api.headers.X-A: is also in headers_from_env: name a header once"),
    ({"headers": {"X-A": "fixed"}},
     "upstreams.api.credentials: no header uses {credential}"),
    ({"credentials": None},
     "upstreams.api.headers.Authorization: {credential} needs the upstream's credentials"),
    ({"credentials": {"directory": "/nonexistent/sweeper"}},
     "upstreams.api.credentials.directory: /nonexistent/sweeper is not a directory"),
    ({"credentials": {}}, "upstreams.api.credentials: name exactly one source"),
    ({"credentials": {"api": True, "directory": "/srv/x"}}, "name exactly one source"),
    ({"credentials": {"api": False}}, "name exactly one source"),
])
def test_a_credential_setup_that_cannot_work_is_refused(
        tmp_path: Path, upstream: dict[str, Any], expected: str) -> None:
    found = problems(doc(tmp_path, **upstream), {"V": "v"})
    assert any(expected in p for p in found), found


def test_per_tenant_credentials_need_a_scope_per_tenant(tmp_path: Path) -> None:
    """One tenant without a credential pauses its scope: a shared scope would stop every
    other tenant's items too."""
    assert problems(doc(tmp_path, scope="credential:{upstream}")) == [
        "policies.p.scope: upstream 'api' has per-tenant credentials: the scope must contain "
        "{tenant_id}"]


def test_credentials_through_the_api_need_the_key(tmp_path: Path) -> None:
    policies = resolve_policies(doc(tmp_path, credentials={"api": True}), {}, source="f.toml")
    [problem] = missing_key(policies, None)
    assert "upstreams.api.credentials: api = true needs SWEEPER_CREDENTIALS_KEY" in problem
    assert missing_key(policies, Keyring([bytes(32)])) == []
    directory = resolve_policies(doc(tmp_path), {}, source="f.toml")
    assert missing_key(directory, None) == []
