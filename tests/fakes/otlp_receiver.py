"""An OTLP/HTTP trace receiver on loopback, built from the `opentelemetry-proto` messages: what
a collector receives from the OTLP exporter (POST /v1/traces, protobuf, gzip or not), kept as
plain spans for tests to assert on."""

from __future__ import annotations

import gzip
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer",
         5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: str
    scope: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    start_ns: int
    end_ns: int


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class OtlpReceiver:
    """Start with `start()`; `spans` grows as exports arrive; `wait_for` polls it."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._lock = threading.Lock()
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        span.name, span.trace_id.hex(), span.span_id.hex(),
                        span.parent_span_id.hex(), KINDS[span.kind], scope_spans.scope.name,
                        _attributes(span.attributes), resource,
                        tuple((link.trace_id.hex(), link.span_id.hex())
                              for link in span.links),
                        span.start_time_unix_nano, span.end_time_unix_nano))
        with self._lock:
            self.requests += 1
            self.spans.extend(received)

    def names(self) -> Counter[str]:
        with self._lock:
            return Counter(span.name for span in self.spans)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]

    def wait_for(self, done: Callable[[OtlpReceiver], bool], timeout_s: float = 60,
                 alive: Callable[[], None] = lambda: None) -> None:
        """Until `done(self)` holds (`alive` raises when what sends the spans died)."""
        deadline = time.monotonic() + timeout_s
        while not done(self):
            alive()
            assert time.monotonic() < deadline, f"spans never arrived; so far: {self.names()}"
            time.sleep(0.05)
