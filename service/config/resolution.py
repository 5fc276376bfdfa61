"""One resolution of a policies file, shared by the resolvers of its sections: the environment
its secrets are read from, and every problem found so far, each naming the file and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from service.config.placeholders import TemplateProblems


@dataclass
class Resolution:
    """The file being resolved (`source`), its environment, and the problems found in it."""

    source: str
    env: Mapping[str, str] = field(repr=False)
    problems: list[str] = field(default_factory=list)

    def fail(self, key: str, message: str) -> None:
        """Note what is wrong at `key`."""
        self.problems.append(f"policies file {self.source}: {key}: {message}")

    def fail_template(self, key: str, exc: TemplateProblems) -> None:
        """Note each problem of a template, its key under `key`."""
        for sub, message in exc.problems:
            self.fail(f"{key}.{sub}", message)

    def mark(self) -> int:
        """Where the problems noted so far end: an entry's checks begin here, and
        `found_since` tells whether they found any."""
        return len(self.problems)

    def found_since(self, mark: int) -> bool:
        """Whether a problem was noted after `mark`."""
        return len(self.problems) > mark

    def secret(self, var: str, key: str) -> str:
        """A secret from the environment, less one trailing line break, as a credential
        file's (a secret mounted from a file usually ends in one, and with it a header could
        not be sent, a signature never match, a DSN never parse)."""
        raw = str(self.env.get(var) or "")
        value = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
        if not raw:
            self.fail(key, f"environment variable {var} is not set")
        elif not value:
            self.fail(key, f"environment variable {var} holds only a line break")
        return value
