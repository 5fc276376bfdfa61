"""Sweeper's own error types. Foreign errors are mapped once, at the boundary, to these.

    SweeperError
    ├── ConfigError            settings or policies file refused at start-up (exit 2)
    ├── DatabaseUnavailable    could not reach PostgreSQL (API answers 503, CLI exits 3)
    ├── ListenError            an address the process cannot listen on (CLI exits 4)
    ├── NotLeader              a leader's duty found its term over (service/cluster/leader.py)
    └── Problem                an HTTP-facing failure rendered as RFC 9457 problem details
"""

from __future__ import annotations

from typing import Any

PROBLEM_TYPE_BASE = "urn:sweeper:problem:"


class SweeperError(Exception):
    """Base of every error Sweeper raises on purpose."""


class ConfigError(SweeperError):
    """Configuration refused; each problem names the source, the key and what is wrong.
    Checks that can see several problems report them all at once."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems: tuple[str, ...] = problems


class DatabaseUnavailable(SweeperError):
    """PostgreSQL could not be reached or refused the connection."""


class ListenError(SweeperError):
    """A port in use, an address not on this host, or one the process may not bind."""


class NotLeader(SweeperError):
    """A duty statement fenced by a leader's term found that term's lease lapsed: it wrote
    nothing, and the duty stops (another process leads, or will)."""


class Problem(SweeperError):
    """An error answer: `slug` is the stable machine-readable part of the problem `type`."""

    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def body(self, instance: str | None = None) -> dict[str, Any]:
        """The problem+json document (RFC 9457)."""
        doc: dict[str, Any] = {
            "type": PROBLEM_TYPE_BASE + self.slug,
            "title": self.title,
            "status": self.status,
        }
        if self.detail:
            doc["detail"] = self.detail
        if instance:
            doc["instance"] = instance
        doc.update(self.extra)
        return doc
