"""Per-tenant upstream credentials: the API over real HTTP against a real database, the
worker's cached read side, key rotation (the library and `sweeper credentials rotate-key`),
the directory source over a kubelet-shaped Secret volume, and no secret in any answer,
audit row or log record."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from service.commands import cli
from service.commands.exits import Exit
from service.config.policies import Policies
from service.config.settings import async_url
from service.credentials import (
    CredentialStore,
    CredentialUnreadable,
    DirectorySource,
    Keyring,
    tenant_credentials,
)
from service.credentials.crypto import Sealed, key_id
from service.credentials.source import MAX_SECRET_CHARS
from service.db.engine import is_unavailable, make_engine
from service.observability.logs import JsonFormatter
from service.observability.metrics import REGISTRY
from service.protocols.egress import public_roots
from tests.conftest import LiveServer, policies_from, test_settings
from tests.fakes.clock import ManualClock

KEY_A = bytes(range(32))
KEY_B = bytes(range(100, 132))
KEY_C = bytes(range(200, 232))
SECRET = "shop-token-Zq7-" + "k9" * 10  # distinctive: searched for in every output
OTHER_SECRET = "shop-token-Wx4-" + "m3" * 10
TENANT = "acme.myshopify.com"
PUT_PATH = f"/v1/tenants/{TENANT}/credentials/shop"


def b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


@pytest.fixture
def policies() -> Policies:
    stored = {"credentials": {"api": True}, "headers": {"Authorization": "Bearer {credential}"}}
    return policies_from({"upstreams": {"shop": {"base_url": "http://127.0.0.1:9", **stored},
                                        "ads": {"base_url": "http://127.0.0.1:9", **stored},
                                        "fixed": {"base_url": "http://127.0.0.1:9"}}})


@asynccontextmanager
async def serve(db_url: str, policies: Policies, **settings: object
                ) -> AsyncIterator[httpx.AsyncClient]:
    async with LiveServer(test_settings(db_url, **settings), policies, db_url) as live:
        async with live.client() as client:
            yield client


@pytest.fixture
async def api(db_url: str, policies: Policies) -> AsyncIterator[httpx.AsyncClient]:
    """A replica with SWEEPER_CREDENTIALS_KEY set (key A)."""
    async with serve(db_url, policies, credentials_key=b64(KEY_A)) as client:
        yield client


async def audit_rows(db_url: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch("SELECT action, reason, details::text AS details "
                                "FROM operator_actions ORDER BY id")
    finally:
        await conn.close()
    return [(r["action"], r["reason"], json.loads(r["details"])) for r in rows]


async def stored_row(db_url: str, tenant_id: str, upstream: str) -> asyncpg.Record:
    conn = await asyncpg.connect(db_url)
    try:
        return await conn.fetchrow("SELECT * FROM tenant_credentials WHERE tenant_id = $1 "
                                   "AND upstream = $2", tenant_id, upstream)
    finally:
        await conn.close()


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json", response.text
    return str(response.json()["type"]).removeprefix("urn:sweeper:problem:")


# -- the API -------------------------------------------------------------------------------

async def test_put_list_delete(api: httpx.AsyncClient, db_url: str) -> None:
    put = await api.put(PUT_PATH, json={"secret": SECRET, "reason": "shop installed the app"})
    assert put.status_code == 200, put.text
    body = put.json()
    assert set(body) == {"tenant_id", "upstream", "fingerprint", "updated_at", "updated_by"}
    assert (body["tenant_id"], body["upstream"]) == (TENANT, "shop")
    assert body["fingerprint"] == Keyring([KEY_A]).fingerprint(SECRET)
    assert body["updated_by"].startswith("token:")
    assert SECRET not in put.text

    listed = await api.get(f"/v1/tenants/{TENANT}/credentials")
    assert listed.status_code == 200
    assert listed.json() == {"credentials": [{k: body[k] for k in (
        "upstream", "fingerprint", "updated_at", "updated_by")}]}

    row = await stored_row(db_url, TENANT, "shop")
    assert row["key_id"] == key_id(KEY_A) and len(row["nonce"]) == 12
    assert SECRET.encode() not in row["ciphertext"]
    sealed = Sealed(row["key_id"], row["nonce"], row["ciphertext"])
    assert Keyring([KEY_A]).open(sealed, TENANT, "shop") == SECRET

    deleted = await api.delete(PUT_PATH)
    assert (deleted.status_code, deleted.content) == (204, b"")
    again = await api.delete(PUT_PATH)
    assert again.status_code == 404 and problem_type(again) == "credential-not-found"
    gone = await api.get(f"/v1/tenants/{TENANT}/credentials")
    assert gone.status_code == 404 and problem_type(gone) == "credential-not-found"
    assert TENANT not in again.text + gone.text  # answers never carry a tenant id

    actions = await audit_rows(db_url)
    assert [(a, r) for a, r, _ in actions] == [("credential.put", "shop installed the app"),
                                               ("credential.delete", None)]
    assert actions[0][2] == {"tenant_id": TENANT, "upstream": "shop",
                             "fingerprint": body["fingerprint"], "previous_fingerprint": None,
                             "key_id": key_id(KEY_A)}
    assert actions[1][2] == {"tenant_id": TENANT, "upstream": "shop",
                             "fingerprint": body["fingerprint"]}
    assert SECRET not in json.dumps(actions)


async def test_a_second_put_rotates_the_secret(api: httpx.AsyncClient, db_url: str) -> None:
    first = (await api.put(PUT_PATH, json={"secret": SECRET})).json()
    second = (await api.put(PUT_PATH, json={"secret": OTHER_SECRET})).json()
    assert second["fingerprint"] != first["fingerprint"]
    assert second["updated_at"] > first["updated_at"]
    (listed,) = (await api.get(f"/v1/tenants/{TENANT}/credentials")).json()["credentials"]
    assert listed["fingerprint"] == second["fingerprint"]
    # the same secret again has the same fingerprint: operators compare without seeing it
    third = (await api.put(PUT_PATH, json={"secret": SECRET})).json()
    assert third["fingerprint"] == first["fingerprint"]
    put_details = [d for a, _, d in await audit_rows(db_url) if a == "credential.put"]
    assert [d["previous_fingerprint"] for d in put_details] == [
        None, first["fingerprint"], second["fingerprint"]]
    # another upstream of the same tenant is another row
    assert (await api.put(f"/v1/tenants/{TENANT}/credentials/ads",
                          json={"secret": OTHER_SECRET})).status_code == 200
    upstreams = [c["upstream"] for c in (
        await api.get(f"/v1/tenants/{TENANT}/credentials")).json()["credentials"]]
    assert upstreams == ["ads", "shop"]


async def test_an_unknown_body_field_is_named(api: httpx.AsyncClient) -> None:
    response = await api.put(PUT_PATH, json={"secret": SECRET, "secert": SECRET})
    assert response.status_code == 422
    assert [(e["loc"], e["type"]) for e in response.json()["errors"]] == [
        (["body", "secert"], "extra_forbidden")]
    assert SECRET not in response.text
    for body in ({"secret": 12345678}, {}, {"secret": None}):
        refused = await api.put(PUT_PATH, json=body)
        assert refused.status_code == 422
        assert [e["loc"] for e in refused.json()["errors"]] == [["body", "secret"]]


@pytest.mark.parametrize("secret", [
    "", SECRET + "x" * (MAX_SECRET_CHARS - len(SECRET) + 1), f"{SECRET}\n", f"{SECRET}\r\nX: y",
    f"{SECRET}\x00", f"\t{SECRET}", f" {SECRET}", f"{SECRET} ", f"{SECRET}é", f"{SECRET}\x7f"],
    ids=["empty", "too-long", "newline", "header-injection", "nul", "tab", "leading-space",
         "trailing-space", "non-ascii", "del"])
async def test_a_refused_secret_is_never_echoed(api: httpx.AsyncClient, db_url: str,
                                                secret: str) -> None:
    response = await api.put(PUT_PATH, json={"secret": secret})
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["errors"]] == [["body", "secret"]]
    assert "items" not in response.json()["errors"][0]["message"]
    assert SECRET not in response.text and "k9k9" not in response.text
    assert await stored_row(db_url, TENANT, "shop") is None


async def test_the_longest_secret_is_stored(api: httpx.AsyncClient, engine: AsyncEngine
                                            ) -> None:
    longest = (SECRET + " ~" * MAX_SECRET_CHARS)[:MAX_SECRET_CHARS - 1] + "~"
    assert len(longest) == MAX_SECRET_CHARS
    assert (await api.put(PUT_PATH, json={"secret": longest})).status_code == 200
    assert await CredentialStore(engine, Keyring([KEY_A])).get(TENANT, "shop") == longest


@pytest.mark.parametrize(("tenant", "status"), [
    ("%2E%2E", 422), ("%2E", 422), ("x" * 513, 422), ("é" * 256, 200), ("é" * 257, 422),
    ("bad%09tenant", 422), ("bad%7Ftenant", 422), ("org%2Facme", 200), ("50%25 off", 200),
    # a line break ends the route's match: no route, so 404 (still never stored)
    ("bad%0Atenant", 404)])
async def test_tenant_ids_are_bounded_as_items_are(api: httpx.AsyncClient, db_url: str,
                                                   tenant: str, status: int) -> None:
    path = f"/v1/tenants/{tenant}/credentials"
    response = await api.put(f"{path}/shop", json={"secret": SECRET})
    assert response.status_code == status, response.text
    listed = await api.get(path)
    assert listed.status_code == status
    if status == 422:
        assert [e["loc"] for e in response.json()["errors"]] == [["path", "tenant_id"]]
    elif status == 200:
        # '/' travels as %2F and the tenant id is whole again on the server
        tenant_id = {"org%2Facme": "org/acme", "50%25 off": "50% off"}.get(tenant, tenant)
        assert await stored_row(db_url, tenant_id, "shop") is not None
        assert (await api.delete(f"{path}/shop")).status_code == 204


async def test_an_upstream_name_is_a_policies_file_name(api: httpx.AsyncClient) -> None:
    response = await api.put(f"/v1/tenants/{TENANT}/credentials/Shop", json={"secret": SECRET})
    assert response.status_code == 422
    assert [e["loc"] for e in response.json()["errors"]] == [["path", "upstream"]]


async def test_an_unknown_upstream_is_404_naming_it(api: httpx.AsyncClient) -> None:
    response = await api.put(f"/v1/tenants/{TENANT}/credentials/nowhere",
                              json={"secret": SECRET})
    assert response.status_code == 404 and problem_type(response) == "upstream-not-found"
    assert "'nowhere'" in response.json()["detail"] and SECRET not in response.text
    # an upstream whose credentials do not come from the API takes none
    fixed = await api.put(f"/v1/tenants/{TENANT}/credentials/fixed", json={"secret": SECRET})
    assert fixed.status_code == 404 and problem_type(fixed) == "upstream-not-found"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer not-a-valid-token-at-all"}])
async def test_unauthenticated_requests_are_refused(api: httpx.AsyncClient,
                                                    headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(verify=public_roots(), base_url=str(api.base_url),
                                 headers=headers) as anonymous:
        for method, path in (("PUT", PUT_PATH), ("DELETE", PUT_PATH),
                             ("GET", f"/v1/tenants/{TENANT}/credentials")):
            response = await anonymous.request(method, path, json={"secret": SECRET})
            assert response.status_code == 401 and problem_type(response) == "unauthorized"


async def test_without_a_key_storage_is_refused(db_url: str, policies: Policies,
                                                engine: AsyncEngine) -> None:
    await tenant_credentials.put(engine, Keyring([KEY_A]), TENANT, "ads", SECRET, actor="test")
    async with serve(db_url, policies) as api:
        refused = await api.put(PUT_PATH, json={"secret": SECRET})
        assert refused.status_code == 409 and problem_type(refused) == "credential-storage-off"
        assert "SWEEPER_CREDENTIALS_KEY" in refused.json()["detail"]
        assert SECRET not in refused.text
        # what needs no key still works: the list, and removing a stored credential
        listed = (await api.get(f"/v1/tenants/{TENANT}/credentials")).json()["credentials"]
        assert [c["upstream"] for c in listed] == ["ads"]
        assert (await api.delete(f"/v1/tenants/{TENANT}/credentials/ads")).status_code == 204


# -- the worker's read side ----------------------------------------------------------------

def checkouts() -> float:
    """Connections taken from any pool of this process so far (every statement takes one)."""
    return REGISTRY.get_sample_value("sweeper_db_pool_wait_seconds_count") or 0.0


async def test_the_store_caches_briefly(engine: AsyncEngine) -> None:
    keyring, clock = Keyring([KEY_A]), ManualClock()
    store = CredentialStore(engine, keyring, ttl_s=5.0, negative_ttl_s=1.0, clock=clock)
    assert await store.get(TENANT, "shop") is None
    # another replica stores it: visible here once the absence is no longer cached
    await tenant_credentials.put(engine, keyring, TENANT, "shop", SECRET, actor="test")
    assert await store.get(TENANT, "shop") is None
    clock.now += 1.01
    assert await store.get(TENANT, "shop") == SECRET
    # ...and replaces it: the old value for at most the TTL
    await tenant_credentials.put(engine, keyring, TENANT, "shop", OTHER_SECRET, actor="test")
    clock.now += 4.9
    assert await store.get(TENANT, "shop") == SECRET
    clock.now += 0.2
    assert await store.get(TENANT, "shop") == OTHER_SECRET
    await tenant_credentials.delete(engine, TENANT, "shop", actor="test")
    assert await store.get(TENANT, "shop") == OTHER_SECRET
    clock.now += 5.01
    assert await store.get(TENANT, "shop") is None
    # this replica's own write: invalidated, seen at once
    await tenant_credentials.put(engine, keyring, TENANT, "shop", SECRET, actor="test")
    store.invalidate(TENANT, "shop")
    assert await store.get(TENANT, "shop") == SECRET


async def test_a_put_reaches_another_replica_within_the_ttl(api: httpx.AsyncClient,
                                                            db_url: str) -> None:
    engine = make_engine(async_url(db_url), test_settings(db_url))
    try:
        clock = ManualClock()
        store = CredentialStore(engine, Keyring([KEY_A]), ttl_s=0.2, negative_ttl_s=0.1,
                                clock=clock)
        assert (await api.put(PUT_PATH, json={"secret": SECRET})).status_code == 200
        assert await store.get(TENANT, "shop") == SECRET
        assert (await api.put(PUT_PATH, json={"secret": OTHER_SECRET})).status_code == 200
        assert await store.get(TENANT, "shop") == SECRET  # cached
        clock.advance(0.21)
        assert await store.get(TENANT, "shop") == OTHER_SECRET
    finally:
        await engine.dispose()


async def test_concurrent_misses_share_one_read(engine: AsyncEngine) -> None:
    keyring = Keyring([KEY_A])
    await tenant_credentials.put(engine, keyring, TENANT, "shop", SECRET, actor="test")
    store = CredentialStore(engine, keyring)
    before = checkouts()
    assert await asyncio.gather(*(store.get(TENANT, "shop") for _ in range(200))) == [
        SECRET] * 200
    assert checkouts() - before == 1
    # hits cost nothing
    for _ in range(1000):
        assert await store.get(TENANT, "shop") == SECRET
    assert checkouts() - before == 1


async def test_the_cache_is_bounded(engine: AsyncEngine) -> None:
    store = CredentialStore(engine, Keyring([KEY_A]), max_entries=2)
    for tenant in ("a", "b", "c"):
        assert await store.get(tenant, "shop") is None
    before = checkouts()
    await store.get("c", "shop")
    await store.get("b", "shop")
    assert checkouts() == before
    await store.get("a", "shop")  # the least recently used was dropped
    assert checkouts() == before + 1


async def test_a_failed_read_is_raised_and_not_cached() -> None:
    gone = "postgresql://postgres@127.0.0.1:1/nowhere"
    engine = make_engine(async_url(gone), test_settings(gone))
    try:
        store = CredentialStore(engine, Keyring([KEY_A]))
        for _ in range(2):  # each get tries again: no answer was cached
            with pytest.raises(Exception) as caught:  # noqa: PT011 - the driver's, mapped later
                await asyncio.gather(store.get(TENANT, "shop"), store.get(TENANT, "shop"))
            assert is_unavailable(caught.value)
    finally:
        await engine.dispose()


async def test_a_row_moved_to_another_tenant_does_not_open(
        engine: AsyncEngine, db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    keyring = Keyring([KEY_A])
    await tenant_credentials.put(engine, keyring, TENANT, "shop", SECRET, actor="test")
    await tenant_credentials.put(engine, keyring, "globex", "shop", OTHER_SECRET, actor="test")
    # someone with write access to the table but no key copies acme's token to globex
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(
            "UPDATE tenant_credentials g SET key_id = a.key_id, nonce = a.nonce, "
            "ciphertext = a.ciphertext FROM tenant_credentials a "
            "WHERE a.tenant_id = $1 AND g.tenant_id = 'globex'", TENANT)
    finally:
        await conn.close()
    sealed = await tenant_credentials.read(engine, "globex", "shop")
    assert sealed is not None
    with pytest.raises(CredentialUnreadable, match="copied from another row"):
        keyring.open(sealed, "globex", "shop")

    caplog.set_level(logging.DEBUG)
    store = CredentialStore(engine, keyring)
    assert await store.get("globex", "shop") is None  # no credential, to the worker
    assert await store.get(TENANT, "shop") == SECRET
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == "credential unreadable: treated as none"
    assert (warning.tenant_id, warning.upstream, warning.key_id) == (  # type: ignore[attr-defined]
        "globex", "shop", key_id(KEY_A))
    assert_no_secret(caplog.records)


# -- key rotation --------------------------------------------------------------------------

async def test_previous_keys_open_and_reencryption_moves_rows(engine: AsyncEngine,
                                                              db_url: str) -> None:
    old, lost = Keyring([KEY_A]), Keyring([KEY_C])
    for tenant in ("acme", "globex", "initech"):
        await tenant_credentials.put(engine, old, tenant, "shop", f"{SECRET}-{tenant}",
                                     actor="test")
    await tenant_credentials.put(engine, lost, "umbrella", "shop", SECRET, actor="test")
    rotated = Keyring([KEY_B, KEY_A])
    store = CredentialStore(engine, rotated)
    assert await store.get("globex", "shop") == f"{SECRET}-globex"  # still under key A
    before = (await stored_row(db_url, "globex", "shop"))["fingerprint"]

    done = await tenant_credentials.reencrypt(engine, rotated, actor="test", page_rows=2)
    assert (done.reencrypted, done.replaced_meanwhile) == (3, 0)
    assert list(done.unreadable) == [("umbrella", "shop", key_id(KEY_C))]
    for tenant in ("acme", "globex", "initech"):
        row = await stored_row(db_url, tenant, "shop")
        assert row["key_id"] == key_id(KEY_B)
        assert row["fingerprint"] == rotated.fingerprint(f"{SECRET}-{tenant}")
    # the fingerprint is keyed by the current key: a new key gives every row a new one
    assert (await stored_row(db_url, "globex", "shop"))["fingerprint"] != before
    # key A can go: the current key alone opens every row it moved
    only_b = CredentialStore(engine, Keyring([KEY_B]))
    assert await only_b.get("initech", "shop") == f"{SECRET}-initech"
    assert await only_b.get("umbrella", "shop") is None
    # a second pass has nothing left to move
    again = await tenant_credentials.reencrypt(engine, rotated, actor="test")
    assert (again.reencrypted, len(again.unreadable)) == (0, 1)
    audits = [d for a, _, d in await audit_rows(db_url) if a == "credential.reencrypt"]
    assert audits[0] == {"key_id": key_id(KEY_B), "reencrypted": 3, "replaced_meanwhile": 0,
                         "unreadable": 1}


@pytest.fixture
def command_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No SWEEPER_* variable of the machine reaches the command; its logging is undone."""
    for name in list(os.environ):
        if name.startswith("SWEEPER_"):
            monkeypatch.delenv(name)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield monkeypatch
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_rotate_key_command(db_url: str, command_environment: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    async def seed(keyring: Keyring, tenant: str) -> None:
        engine = make_engine(async_url(db_url), test_settings(db_url))
        try:
            await tenant_credentials.put(engine, keyring, tenant, "shop", SECRET, actor="test")
        finally:
            await engine.dispose()

    asyncio.run(seed(Keyring([KEY_A]), "acme"))
    env = command_environment
    env.setenv("SWEEPER_DATABASE_URL", db_url)
    assert cli.main(["credentials", "rotate-key"]) == Exit.CONFIG  # no key to move them to
    assert "SWEEPER_CREDENTIALS_KEY: must be set" in capsys.readouterr().err

    env.setenv("SWEEPER_CREDENTIALS_KEY", b64(KEY_B))
    env.setenv("SWEEPER_CREDENTIALS_PREVIOUS_KEYS", b64(KEY_A))
    assert cli.main(["credentials", "rotate-key"]) == Exit.OK
    out, err = capsys.readouterr()
    assert out == (f"1 credential(s) re-encrypted under key {key_id(KEY_B)}, 0 replaced "
                   "meanwhile, 0 unreadable\n")
    assert SECRET not in out + err

    asyncio.run(seed(Keyring([KEY_C]), "umbrella"))
    assert cli.main(["credentials", "rotate-key"]) == Exit.INCOMPLETE
    out, err = capsys.readouterr()
    assert out.endswith(", 1 unreadable\n")
    assert '"tenant_id": "umbrella"' in err and SECRET not in out + err

    env.setenv("SWEEPER_DATABASE_URL", "postgresql://postgres@127.0.0.1:1/sweeper")
    assert cli.main(["credentials", "rotate-key"]) == Exit.DATABASE
    assert "cannot reach PostgreSQL" in capsys.readouterr().err


# -- nothing logged ------------------------------------------------------------------------

def assert_no_secret(found: list[logging.LogRecord], *secrets: str) -> None:
    formatter = JsonFormatter()
    for record in found:
        shown = " ".join((record.getMessage(), repr(record.__dict__), formatter.format(record)))
        for secret in (SECRET, OTHER_SECRET, *secrets):
            assert secret not in shown, record


async def test_no_log_record_holds_a_secret(db_url: str, policies: Policies,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    refused = f"{SECRET}\n"
    async with serve(db_url, policies, credentials_key=b64(KEY_A), log_level="DEBUG") as api:
        assert (await api.put(PUT_PATH, json={"secret": SECRET})).status_code == 200
        assert (await api.put(PUT_PATH, json={"secret": refused})).status_code == 422
        assert (await api.put(PUT_PATH, json={"secret": OTHER_SECRET, "x": SECRET})
                ).status_code == 422
        assert (await api.get(f"/v1/tenants/{TENANT}/credentials")).status_code == 200
        engine = make_engine(async_url(db_url), test_settings(db_url))
        try:
            store = CredentialStore(engine, Keyring([KEY_A]))
            assert await store.get(TENANT, "shop") == SECRET
            assert await store.get(TENANT, "shop") == SECRET
            await tenant_credentials.reencrypt(engine, Keyring([KEY_B, KEY_A]), actor="test")
        finally:
            await engine.dispose()
    requests = [r for r in caplog.records if r.getMessage() == "request"]
    assert len(requests) == 4  # the records were captured: the control
    assert_no_secret(caplog.records, refused)


# -- the directory source ------------------------------------------------------------------

class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: each key a symlink through
    `..data`, which points to a timestamped directory swapped whole on every update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0

    def publish(self, files: dict[str, bytes]) -> None:
        self.generation += 1
        data = self.root / f"..2026_12_02_00_00_0{self.generation}.000"
        data.mkdir()
        for name, content in files.items():
            (data / name).write_bytes(content)
        link = self.root / "..data_tmp"
        link.symlink_to(data.name)
        os.replace(link, self.root / "..data")  # the atomic swap
        for name in files:
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")


@pytest.fixture
def volume(tmp_path: Path) -> SecretVolume:
    root = tmp_path / "shop-credentials"
    root.mkdir()
    return SecretVolume(root)


async def test_the_directory_source_reads_and_follows_updates(volume: SecretVolume) -> None:
    clock = ManualClock()
    source = DirectorySource(volume.root, recheck_s=1.0, clock=clock)
    volume.publish({"acme.myshopify.com": f"{SECRET}\n".encode(), "globex": b"g-token\r\n"})
    assert await source.get("acme.myshopify.com", "shop") == SECRET  # one newline stripped
    assert await source.get("globex", "shop") == "g-token"
    assert await source.get("initech", "shop") is None  # no file

    volume.publish({"acme.myshopify.com": f"{OTHER_SECRET}\n".encode(),
                    "globex": b"g-token\r\n", "initech": b"i-token"})
    assert await source.get("acme.myshopify.com", "shop") == SECRET  # checked once a second
    clock.now += 1.0
    assert await source.get("acme.myshopify.com", "shop") == OTHER_SECRET
    assert await source.get("initech", "shop") == "i-token"
    # the file replaced in place (no kubelet): a new size or mtime is a new credential too
    target = volume.root / "..data" / "globex"
    target.write_bytes(b"g-token-2")
    os.utime(target, ns=(0, 10**18))
    clock.now += 1.0
    assert await source.get("globex", "shop") == "g-token-2"


@pytest.mark.parametrize("tenant", [
    "../x", "..", ".", "..data", "..2026_12_02_00_00_01.000", "a/b", "/etc/passwd", "",
    "tenant with space", "acme\n", "x" * 254, "ünïcode"])
async def test_a_tenant_id_never_names_a_path_outside(volume: SecretVolume, tmp_path: Path,
                                                     tenant: str) -> None:
    (tmp_path / "x").write_text("outside")
    volume.publish({"x": b"inside"})
    assert await DirectorySource(volume.root).get(tenant, "shop") is None


async def test_files_that_are_no_credential(volume: SecretVolume, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    outside = tmp_path / "outside"
    outside.write_text("stolen")
    volume.publish({"big": b"x" * (MAX_SECRET_CHARS + 3), "longest": b"y" * MAX_SECRET_CHARS
                    + b"\n", "ctl": f"{SECRET}\x01x".encode(), "latin": "café".encode(),
                    "empty": b"", "twolines": b"a\n\n"})
    (volume.root / "escape").symlink_to(outside)
    (volume.root / "subdir").mkdir()
    source = DirectorySource(volume.root)
    for name in ("big", "ctl", "latin", "empty", "twolines", "escape", "subdir"):
        assert await source.get(name, "shop") is None, name
    assert await source.get("longest", "shop") == "y" * MAX_SECRET_CHARS
    refused = {r.tenant_id: r.problem for r in caplog.records  # type: ignore[attr-defined]
               if r.getMessage() == "credential file refused"}
    assert set(refused) == {"big", "ctl", "latin", "empty", "twolines", "escape", "subdir"}
    assert refused["escape"] == "resolves to a path outside the directory"
    assert_no_secret(caplog.records)
    # refused once per change, not once per call
    for _ in range(3):
        await source.get("ctl", "shop")
    assert len([r for r in caplog.records if r.getMessage() == "credential file refused"]) == 7
