"""`sweeper serve` as its own OS process, the way it is deployed: one uvicorn process on
loopback, API only (no workers), for the benchmarks that measure the HTTP surface."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

TOKEN = secrets.token_hex(16)  # a fresh token per benchmark process
POLICIES = """
[upstreams.shop]
base_url = "http://127.0.0.1:9"
timeout_seconds = 5

[policies.carts]
version = 1
upstream = "shop"
path = "/carts/{object_id}"
scope = "tenant:{tenant_id}"
rate = { per_second = 1000, burst = 1000 }
lease_seconds = 30
"""


@dataclass(frozen=True)
class Server:
    base_url: str
    headers: dict[str, str]
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def sweeper_server(database_url: str, *, workers: int = 0, batch_size: int = 500,
                         extra_env: dict[str, str] | None = None) -> AsyncIterator[Server]:
    """Start `sweeper serve` on `database_url` (already migrated) and wait until ready."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sweeper-bench-server-") as tmp:
        policies = Path(tmp) / "policies.toml"
        policies.write_text(POLICIES)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
        env.update({"SWEEPER_DATABASE_URL": database_url, "SWEEPER_POLICIES_FILE": str(policies),
                    "SWEEPER_API_TOKENS": TOKEN, "SWEEPER_WORKERS": str(workers),
                    "SWEEPER_PORT": str(port), "SWEEPER_LOG_LEVEL": "WARNING",
                    "SWEEPER_LOG_FORMAT": "json", "SWEEPER_BATCH_SIZE": str(batch_size),
                    "SWEEPER_MIGRATE_ON_START": "false", **(extra_env or {})})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "serve", env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            async with httpx.AsyncClient(base_url=base_url, timeout=2) as client:
                while True:
                    if proc.returncode is not None:
                        err = await proc.stderr.read() if proc.stderr else b""
                        raise RuntimeError(f"sweeper serve exited: {err.decode()[-2000:]}")
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError("sweeper serve did not become ready in 60 s")
                    await asyncio.sleep(0.1)
            yield Server(base_url, {"Authorization": f"Bearer {TOKEN}"}, proc.pid)
        finally:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 20)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
