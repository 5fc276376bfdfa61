"""`sweeper demo`: the whole pipeline locally in one command.

An embedded PostgreSQL in a temporary directory, the real HTTP API and worker pool, and a
simulated storefront deletion API (on loopback, as `sweeper local` serves it) that enforces
a per-tenant rate limit with 429 + Retry-After and now and then answers 404 (already gone)
or 503 (try later). A few thousand items over several tenants are registered over HTTP, a
dry run reports on them, then a run is triggered and its drain followed with the progress
bar.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from service.commands import run_client
from service.commands.local import signing_key
from service.commands.local.store import SimulatedStore, Weather
from service.config.policies import Policies, resolve_policies
from service.config.settings import LogFormat, Settings, async_url
from service.db.migrate import migrate_database

log = logging.getLogger(__name__)

TENANT_RATE_PER_S = 40.0
STORE_BURST = 4  # like real storefront APIs, the store tolerates a few calls of jitter
BAD_WEATHER = Weather(unavailable=0.01, absent=0.03)
REGISTER_BATCH = 5000  # items per POST /v1/items


def demo_policies(store_port: int) -> Policies:
    """One storefront (the simulated store on `store_port`) and one cart-retention policy,
    limited per tenant."""
    return resolve_policies({
        "upstreams": {"demo-store": {"base_url": f"http://127.0.0.1:{store_port}",
                                     "timeout_seconds": 5}},
        "policies": {"cart-retention": {
            "version": 1, "upstream": "demo-store", "path": "/tenants/{tenant_id}/carts/"
            "{object_id}", "scope": "tenant:{tenant_id}",
            "rate": {"per_second": TENANT_RATE_PER_S, "burst": 1}, "lease_seconds": 30,
            "max_attempts": 5, "absent_means_deleted": True,
            "backoff": {"base_seconds": 0.2, "max_seconds": 5}}},
    }, {}, source="<demo>")


def cmd_demo(args: argparse.Namespace) -> int:
    """`sweeper demo`."""
    return run_demo(args.items, args.tenants, args.workers, args.keep)


def run_demo(items: int, tenants: int, workers: int, keep: Path | None) -> int:
    """Start an embedded database (a temporary one unless `keep` names a folder) and run."""
    from service.db.embedded import embedded_database

    with embedded_database(keep, prefix="sweeper-demo-") as url:
        return asyncio.run(_demo(url, items, tenants, workers, keep))


async def _demo(url: str, items: int, tenants: int, workers: int, keep: Path | None) -> int:
    """The store and the API served on loopback ports for as long as the demo drives them."""
    # here, not above: the parser imports this module, and `sweeper --help` loads no server
    import uvicorn

    from service.app import create_app
    from service.http.serving import CompanionServer, listening_socket

    token = secrets.token_urlsafe(24)
    key, key_file = signing_key(keep)  # signed as the docs say the embedded database is
    settings = Settings(database_url=url, api_tokens=token, workers=workers,
                        batch_size=250, log_format=LogFormat.CONSOLE, log_level="WARNING",
                        evidence_signing_key=key, evidence_signing_key_file=key_file)
    await migrate_database(async_url(url), settings)
    store = SimulatedStore(rate_per_s=TENANT_RATE_PER_S, burst=STORE_BURST, weather=BAD_WEATHER)
    store_socket = listening_socket("127.0.0.1", 0)
    store_server = CompanionServer(uvicorn.Config(store, log_config=None, access_log=False,
                                                  lifespan="off"))
    storing = asyncio.create_task(store_server.serve(sockets=[store_socket]))
    app = create_app(settings, demo_policies(int(store_socket.getsockname()[1])),
                     async_url(url))
    # bound here and handed to uvicorn: no window in which another process takes the port
    sock = listening_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    print(f"Sweeper demo: API on {base}, {workers} workers, simulated store allowing "
          f"{TENANT_RATE_PER_S:.0f} deletions/s per tenant")
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30,
                                     headers={"Authorization": f"Bearer {token}"}) as client:
            await _drive(client, store, items, tenants)
    finally:
        server.should_exit = True
        await serving
        store_server.should_exit = True
        await storing
    return 0


async def _drive(client: httpx.AsyncClient, store: SimulatedStore, items: int,
                 tenants: int) -> None:
    """Register the expired carts, run a report-only run, then the run, followed with the
    progress bar until it drains."""
    due = datetime.now(UTC) - timedelta(days=31)
    names = [f"shop-{i}.example" for i in range(tenants)]
    batch = [{"tenant_id": names[i % tenants], "object_id": f"cart-{i:06d}",
              "policy": "cart-retention", "due_at": due.isoformat()}
             for i in range(items)]
    for start in range(0, len(batch), REGISTER_BATCH):
        response = await client.post("/v1/items",
                                     json={"items": batch[start:start + REGISTER_BATCH]})
        response.raise_for_status()
    print(f"registered {items} expired carts over {tenants} tenants")
    dry = await run_client.trigger(client, {"dry_run": True}, None)
    report = await run_client.follow(client, int(dry["id"]), out=io.StringIO())
    print(f"report-only run {dry['id']} first (the runbook's advice): "
          f"{report['candidates']} candidates, the oldest due "
          f"{report['oldest_due_at']}; nothing released")
    run = await run_client.trigger(client, {}, f"demo-{datetime.now(UTC):%Y%m%dT%H%M}")
    print(f"run {run['id']} published; draining:")
    final = await run_client.follow(client, int(run["id"]))
    print("done: " + ", ".join(f"{k}={v}" for k, v in sorted(final["items"].items()))
          + f"; upstream calls {store.calls}, answered 429 {store.throttled} times")
