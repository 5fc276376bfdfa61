"""A drill: a named failure scenario with its setup, the fault it injects, the assertion it
checks, and a `run` that returns what it measured; and the verdict it comes to
(drills/runner.py runs one)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Facts = dict[str, Any]


class DrillFailed(AssertionError):
    """The drill's assertion did not hold; the message says what was seen."""


class DrillSkipped(Exception):
    """The drill cannot run here (e.g. no PostgreSQL binaries to restart a server)."""


def check(condition: bool, message: str) -> None:
    """Fail the drill with `message` unless `condition` holds."""
    if not condition:
        raise DrillFailed(message)


@dataclass(frozen=True)
class Drill:
    """One scenario. `run` gets a Stage (see drills.stage) and returns measured
    facts; it raises DrillFailed when the assertion does not hold."""

    number: int
    name: str
    setup: str
    fault: str
    assertion: str
    run: Callable[[Any], Awaitable[Facts]]

    def describe(self) -> str:
        """The text `sweeper drill --list` shows."""
        return (f"{self.number:>2} {self.name}\n     setup:     {self.setup}\n"
                f"     fault:     {self.fault}\n     assertion: {self.assertion}")


@dataclass
class Verdict:
    """What a drill run came to: passed, failed or skipped, with its facts."""

    drill: Drill
    status: str  # pass | fail | skip
    seconds: float
    facts: Facts = field(default_factory=dict)
    reason: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        """One line for a terminal: verdict, drill, duration, facts or the reason."""
        facts = " ".join(f"{k}={_short(v)}" for k, v in self.facts.items())
        headline = (self.reason or "").split("\n", 1)[0]
        tail = f"{headline}  {facts}".strip()
        return (f"{self.status.upper():<4} {self.drill.number:>2} {self.drill.name:<28} "
                f"{self.seconds:6.1f}s  {tail}")

    def details(self) -> str:
        """Everything after the headline of the reason (process log tails of a failure)."""
        return (self.reason or "").partition("\n")[2]

    def as_json(self) -> dict[str, Any]:
        return {"drill": self.drill.name, "number": self.drill.number, "status": self.status,
                "seconds": round(self.seconds, 2), "facts": self.facts, "reason": self.reason}


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
