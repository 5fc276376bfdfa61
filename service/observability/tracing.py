"""OpenTelemetry tracing: off unless the standard OTEL_* variables ask for it, configured by
them as the SDK defines them (exporter, endpoint, protocol, headers, sampler, batch
processor, resource, propagators), never by settings of ours.

On when OTEL_TRACES_EXPORTER names an exporter (not `none`) or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and OTEL_SDK_DISABLED is
not `true`. An item's life is one trace: a run's trigger, its publication, the batch that
released the item, each claim, upstream call and completion of it (docs/operations.md,
"Traces"); the trace context travels in the ledger (`runs.trace_parent`,
`items.trace_parent`) as a W3C `traceparent`, so the trace crosses replicas.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import context, propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import service
from service.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

log = logging.getLogger(__name__)

TRACER_NAME: Final = "sweeper"
# statements outside any traced operation (the leader's heartbeats, idle polls) are not
# exported: each would be a trace of one span
_STATEMENTS_SCOPE: Final = "opentelemetry.instrumentation.asyncpg"
# probes and scrapes are not traced (OTEL_PYTHON_FASTAPI_EXCLUDED_URLS replaces this)
_UNTRACED_PATHS: Final = "/healthz,/readyz,/metrics"
_OTLP_BY_PROTOCOL: Final = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}
_STORED: Final = TraceContextTextMapPropagator()  # the ledger's format, whatever OTEL_PROPAGATORS

_tracer: trace.Tracer | None = None


def requested(environ: Mapping[str, str]) -> bool:
    """Whether these variables turn tracing on (see the module's docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(environ.get(name, "").strip() for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters' entry point names: OTEL_TRACES_EXPORTER (default `otlp`), `otlp`
    resolved by OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL (default
    http/protobuf, as the specification says)."""
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
             if n.strip() and n.strip() != "none"]
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    resolved = []
    for name in names:
        if name == "otlp":
            if protocol not in _OTLP_BY_PROTOCOL:
                raise ConfigError(f"OTLP protocol {protocol!r} is not one of "
                                  f"{', '.join(_OTLP_BY_PROTOCOL)}")
            name = _OTLP_BY_PROTOCOL[protocol]
        resolved.append(name)
    return resolved


def configure(environ: Mapping[str, str] = os.environ) -> bool:
    """Install the process's tracer provider and the statement instrumentation when the
    variables ask for tracing; whether they did. Once per process (the provider is global,
    and the instrumentation patches asyncpg itself)."""
    global _tracer
    if _tracer is not None or not requested(environ):
        return _tracer is not None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    names = exporter_names(environ)
    processors = [BatchSpanProcessor(_exporter(name)()) for name in names]
    # ours are defaults: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override them
    resource = Resource.create({
        "service.name": "sweeper", "service.version": service.__version__,
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
    }).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    for processor in processors:
        provider.add_span_processor(_operations_only(processor))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer(TRACER_NAME, service.__version__)
    # a span for each statement made within a traced operation (parameters never recorded)
    from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

    AsyncPGInstrumentor(capture_parameters=False).instrument(  # type: ignore[no-untyped-call]
        tracer_provider=provider)
    log.info("tracing on", extra={"exporters": names})
    return True


def _exporter(name: str) -> Any:
    """The exporter class registered under `name` (the SDK's entry point group)."""
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed "
                          "(otlp over http/protobuf and console are)")
    return next(iter(found)).load()


def _operations_only(inner: SpanProcessor) -> SpanProcessor:
    """`inner`, passed every span but a statement that belongs to no trace of ours (a root
    span of the SQL instrumentation)."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

    class OperationsOnly(SpanProcessor):
        def on_start(self, span: Any, parent_context: context.Context | None = None) -> None:
            inner.on_start(span, parent_context=parent_context)

        def on_end(self, span: ReadableSpan) -> None:
            scope = span.instrumentation_scope
            if span.parent is None and scope is not None and scope.name == _STATEMENTS_SCOPE:
                return
            inner.on_end(span)

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30_000) -> bool:
            return inner.force_flush(timeout_millis)

    return OperationsOnly()


def tracer() -> trace.Tracer | None:
    """The process's tracer; None while tracing is off (callers then make no spans)."""
    return _tracer


def instrument_app(app: Any) -> None:
    """Trace every HTTP request (the inbound `traceparent` honoured) but probes and
    scrapes; span names and paths are route templates."""
    if _tracer is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    excluded = os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS") or _UNTRACED_PATHS
    FastAPIInstrumentor.instrument_app(app, excluded_urls=excluded,
                                       server_request_hook=_route_not_path,
                                       exclude_spans=["receive", "send"])


def _route_not_path(span: Any, scope: Mapping[str, Any]) -> None:
    """A raw path can carry tenant ids: the span keeps its route template instead."""
    if not span.is_recording():
        return
    route = span.name.partition(" ")[2] or "other"
    recorded = getattr(span, "attributes", None) or {}
    for key in ("http.target", "url.path", "http.url", "url.full"):
        if key in recorded:
            span.set_attribute(key, route)
    if "url.query" in recorded:
        span.set_attribute("url.query", "")


def traceparent(span: trace.Span | None = None) -> str | None:
    """The W3C `traceparent` of `span` (default: the current one) to store in the ledger;
    None when there is none (tracing off, or no span). An unsampled span's is stored too:
    its flags tell the worker to make no spans for the items (`unsampled`)."""
    if _tracer is None:
        return None
    span = span or trace.get_current_span()
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _STORED.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def unsampled(value: str | None) -> bool:
    """Whether a stored `traceparent` says its trace was not sampled: the sampled bit (0x01)
    of its trace flags unset (the SDK sets others too: 0x02 says the trace id is random)."""
    if value is None:
        return False
    try:
        return not int(value.rsplit("-", 1)[1], 16) & 0x01
    except (IndexError, ValueError):
        return False


def stored_context(value: str | None) -> context.Context | None:
    """The context a stored `traceparent` names; None for none (a new trace then starts)."""
    if not value:
        return None
    return _STORED.extract({"traceparent": value})


def inject(headers: MutableMapping[str, str]) -> None:
    """The current trace context in outgoing headers, by OTEL_PROPAGATORS."""
    propagate.inject(headers)
