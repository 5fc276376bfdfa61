"""`sweeper local`: the service with a ready local configuration, to try it in minutes.

An embedded PostgreSQL in a temporary folder (kept with --data-dir), the simulated store of
store.py on 127.0.0.1:8081, the policies file beside this module pointing at it, and the
real API with its workers on 127.0.0.1:8080, accepting the bearer token LOCAL_TOKEN. It
listens on loopback only: the token is printed in the README, so it guards nothing.
`try_commands` are the README's three curl commands; a test runs them as written.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import tomllib
from pathlib import Path

from pydantic import SecretStr
from sqlalchemy.engine import make_url

from service.commands.local.store import SimulatedStore
from service.config import signing_keys
from service.config.policies import Policies, resolve_policies
from service.config.settings import Environment, LogFormat, Settings, async_url
from service.errors import ConfigError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOCAL_TOKEN = "local-token-0123456789"  # noqa: S105 - public on purpose, loopback only
POLICIES_FILE = Path(__file__).with_name("policies.toml")
# The store allows more than the policy spends (policies.toml), so nothing is throttled
# by accident: its bucket refills 25% faster and holds twice the policy's burst.
STORE_RATE_PER_S = 50.0
STORE_BURST = 10


def signing_key(data_dir: Path | None) -> tuple[SecretStr | None, Path | None]:
    """The evidence signing key of an embedded database (`local`, `demo`), as the settings
    `evidence_signing_key` and `evidence_signing_key_file`: they sign as `serve` on the
    embedded database does, with the key kept in the database's folder (`data_dir`, made
    on first use) so that exports of earlier runs still verify; or, for a temporary
    database, with a key of this process, gone with it."""
    if data_dir is None:
        return SecretStr(signing_keys.new_key()), None
    signing_keys.local_key(data_dir)  # made here on first use, read from there by the settings
    return None, data_dir / signing_keys.LOCAL_KEY_FILE


def local_policies(store_port: int) -> Policies:
    """The shipped policies file, its upstream pointed at the store's port."""
    raw = tomllib.loads(POLICIES_FILE.read_text(encoding="utf-8"))
    raw["upstreams"]["local-store"]["base_url"] = f"http://{HOST}:{store_port}"
    return resolve_policies(raw, {}, source=str(POLICIES_FILE))


def try_commands(port: int) -> str:
    """Register three overdue carts, trigger a run, read its status and evidence."""
    api = f"http://{HOST}:{port}"
    auth = f"-H 'Authorization: Bearer {LOCAL_TOKEN}'"
    carts = ", ".join(
        f'{{"tenant_id": "{tenant}", "object_id": "{cart}", "policy": "cart-retention", '
        f'"due_at": "2020-01-01T00:00:00Z"}}'
        for tenant, cart in (("shop-1.example", "cart-1"), ("shop-1.example", "cart-2"),
                             ("shop-2.example", "cart-3")))
    return (f"curl -sS -w '\\n' {api}/v1/items {auth} -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"items\": [{carts}]}}'\n"
            f"curl -sS -w '\\n' {api}/v1/runs {auth} -H 'Content-Type: application/json' \\\n"
            f"  -d '{{\"policy\": \"cart-retention\"}}'\n"
            f"curl -sS -w '\\n' {auth} {api}/v1/runs/1 {api}/v1/runs/1/evidence\n")


def cmd_local(args: argparse.Namespace) -> int:
    """`sweeper local`: its two ports must differ."""
    if args.port == args.store_port:
        raise ConfigError(f"--port and --store-port must differ (both {args.port})")
    return run_local(args.port, args.store_port, args.workers, args.data_dir)


def run_local(port: int, store_port: int, workers: int, data_dir: Path | None) -> int:
    """Bind both ports first (a port in use is refused before anything starts), then the
    embedded database, then serve until Ctrl-C. The database is discarded on exit unless
    `data_dir` names a folder to keep it in."""
    from service.db.embedded import embedded_database
    from service.http.serving import listening_socket

    with (listening_socket(HOST, port) as api_socket,
          listening_socket(HOST, store_port) as store_socket,
          embedded_database(data_dir, prefix="sweeper-local-") as url):
        asyncio.run(_serve(url, api_socket, store_socket, workers, data_dir))
    return 0


async def _serve(url: str, api_socket: socket.socket, store_socket: socket.socket,
                 workers: int, data_dir: Path | None) -> None:
    import uvicorn

    from service.app import create_app
    from service.db.migrate import migrate_database
    from service.http.serving import CompanionServer, GracefulServer, server_config

    port = int(api_socket.getsockname()[1])
    store_port = int(store_socket.getsockname()[1])
    key, key_file = signing_key(data_dir)
    # the environment's other SWEEPER_* settings (log level, batch size...) still apply
    settings = Settings(database_url=url, api_tokens=LOCAL_TOKEN, workers=workers,
                        host=HOST, port=port, environment=Environment.DEVELOPMENT,
                        policies_file=POLICIES_FILE, tls_cert_file=None, tls_key_file=None,
                        log_format=LogFormat.CONSOLE, evidence_signing_key=key,
                        evidence_signing_key_file=key_file)
    await migrate_database(async_url(url), settings)
    store = SimulatedStore(rate_per_s=STORE_RATE_PER_S, burst=STORE_BURST)
    store_server = CompanionServer(uvicorn.Config(store, log_config=None, access_log=False,
                                                  lifespan="off"))
    app = create_app(settings, local_policies(store_port), async_url(url))
    api_server = GracefulServer(server_config(app, settings, host=HOST, port=port))
    stores = asyncio.create_task(store_server.serve(sockets=[store_socket]))
    print(f"Sweeper, locally: the API on http://{HOST}:{port} (bearer token {LOCAL_TOKEN}), "
          f"{workers} workers,\na simulated store on http://{HOST}:{store_port} taking "
          f"{STORE_RATE_PER_S:.0f} deletions/s per tenant, the policies of {POLICIES_FILE},\n"
          f"and PostgreSQL at {make_url(url).render_as_string(hide_password=True)}. "
          f"Ctrl-C stops everything. Try, in another terminal:\n\n"
          f"{try_commands(port)}", flush=True)
    try:
        await api_server.serve(sockets=[api_socket])
    finally:
        store_server.should_exit = True
        await stores
