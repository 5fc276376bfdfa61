"""`sweeper worker`'s probes and metrics on SWEEPER_METRICS_PORT.

A worker has no API, so its one port answers three paths, and 404 elsewhere:

- `/healthz`: 200 while the pool's loop has turned within LOOP_STALL_S (a round, an idle
  poll, a wait for a slot or for the database each turn it), else 503: a hung loop (a
  deadlock, a blocked event loop) gets the pod restarted.
- `/readyz`: 200 once the pool has warmed up and while it is not stopping, else 503.
- `/metrics`: this process's counters and histograms (OpenMetrics when asked).

The server runs on a daemon thread, so it still answers (503) when the event loop it
watches is blocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final, Protocol

from prometheus_client.exposition import choose_encoder

from service.observability.metrics import REGISTRY

LOOP_STALL_S: Final = 60.0  # longest a healthy loop goes without turning (waits are shorter)


class Beating(Protocol):
    """What the probes read of a pool (WorkerPool)."""

    turned_at: float  # on the pool's monotonic clock
    ready: bool


class WorkerHealth:
    """The probes' answers for the pool it watches (none yet: starting, alive, not ready)."""

    def __init__(self, monotonic: Callable[[], float], stall_s: float = LOOP_STALL_S) -> None:
        self._monotonic = monotonic
        self.stall_s = stall_s
        self.pool: Beating | None = None

    def live(self) -> bool:
        return self.pool is None or self._monotonic() - self.pool.turned_at <= self.stall_s

    def ready(self) -> bool:
        return self.pool is not None and self.pool.ready and self.live()


def serve_probes(health: WorkerHealth, host: str, port: int) -> ThreadingHTTPServer:
    """Serve /healthz, /readyz and /metrics on host:port from a daemon thread; the server
    (its `server_address` says the port when 0 was asked)."""

    class Probes(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                # OpenMetrics when the scraper's Accept asks for it, as the API's /metrics
                encode, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._answer(200, encode(REGISTRY), content_type)
            elif path in ("/healthz", "/readyz"):
                ok = health.live() if path == "/healthz" else health.ready()
                self._answer(200 if ok else 503, b"ok\n" if ok else b"unavailable\n")
            else:
                self._answer(404, b"not found\n")

        def _answer(self, status: int, body: bytes,
                    content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return  # probes every few seconds: no line each

    server = ThreadingHTTPServer((host, port), Probes)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server
