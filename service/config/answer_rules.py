"""Answers read from the body: a policy's rules that classify an upstream answer by its status
and its JSON body, before the status table of service/outcomes.py applies.

    [[policies.customer-redact.answers]]
    status = 200                          # one status, a list, or "2xx"; absent: any status
    path = "errors[*].extensions.code"    # a JSON path; absent: the status alone decides
    equals = "THROTTLED"                  # or: present = true (or false)
    outcome = "throttled"
    reason = "throttled"                  # recorded as http_200:throttled
    code = "errors[0].extensions.code"    # optional: recorded too, http_200:throttled:CODE
    version = "errors[0].currentVersion"  # optional, outcome "transient": retry at once
                                          # with this {version} (optimistic concurrency)

The first rule that matches decides; an answer no rule matches goes to the status table.
A path is object keys and list indices (`data.customerDelete.userErrors[0]`); `[*]` is
any element of a list, and a rule matches when any value the path reaches matches. `equals`
compares JSON values exactly (`true` is no `1`); `present = true` holds when a path reaches
a value that is not null, `present = false` when it reaches none.

The body is read only for a status some path rule names, and only up to the policy's
`answer_max_bytes`: a longer body, or one that is not JSON, matches no path rule (it is
never parsed partially). What is recorded is the rule's reason and, when `code` reaches a
short code-like value (letters, digits, `_.:-`), that code: never the message text or any
other part of the payload.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.outcomes import Classified, Outcome

MAX_PATH_STEPS: Final = 32
MAX_RECORDED_CHARS: Final = 64
DEFAULT_MAX_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 1024 * 1024
# what is recorded of a code or carried as a version: short and code-like, never text
_CODE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}", re.ASCII)
_STEP: Final = re.compile(r"([A-Za-z0-9_-]+)((?:\[(?:\d{1,6}|\*)\])*)", re.ASCII)
_INDEX: Final = re.compile(r"\[(\d{1,6}|\*)\]")

ANY: Final = "*"  # the wildcard step: every element of a list

Step = str | int  # an object key, a list index, or ANY
StatusClass = Literal["1xx", "2xx", "3xx", "4xx", "5xx"]
StatusValue = Annotated[int, Field(ge=100, le=599)] | StatusClass


def parse_path(path: str) -> tuple[Step, ...]:
    """The steps of a body path such as `errors[*].extensions.code`; ValueError saying what
    a path looks like."""
    steps: list[Step] = []
    for part in path.split("."):
        match = _STEP.fullmatch(part)
        if match is None:
            raise ValueError(f"{path!r} is not a body path such as 'data.customerDelete."
                             "userErrors[0]' or 'errors[*].extensions.code'")
        steps.append(match[1])
        steps.extend(ANY if i == ANY else int(i) for i in _INDEX.findall(match[2]))
    if len(steps) > MAX_PATH_STEPS:
        raise ValueError(f"{path!r} has more than {MAX_PATH_STEPS} steps")
    return tuple(steps)


def values_at(document: Any, steps: Sequence[Step]) -> list[Any]:
    """Every value the path reaches in a parsed JSON document, in document order (none when
    a step is missing; `[*]` fans out over a list)."""
    found = [document]
    for step in steps:
        reached: list[Any] = []
        for value in found:
            if step == ANY:
                if isinstance(value, list):
                    reached.extend(value)
            elif isinstance(step, int):
                if isinstance(value, list) and step < len(value):
                    reached.append(value[step])
            elif isinstance(value, dict) and step in value:
                reached.append(value[step])
        found = reached
        if not found:
            break
    return found


def same_json(a: Any, b: Any) -> bool:
    """JSON equality: a boolean equals only a boolean (Python's True == 1 does not hold in
    JSON), numbers compare by value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and bool(a == b)


def code_of(value: Any) -> str | None:
    """A string or integer value as a short code, or None when it is not code-like (text
    with spaces, an object, a long string): only codes are ever recorded."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value)
    return text if _CODE.fullmatch(text) else None


def read_json(body: bytes) -> Any:
    """A response body as JSON, or NOT_JSON (not UTF-8, not JSON, nested too deeply, a
    number too long for Python)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        return NOT_JSON


class _NotJson:
    def __repr__(self) -> str:
        return "NOT_JSON"


NOT_JSON: Final = _NotJson()


class AnswerRule(BaseModel):
    """One rule of a policy's `answers`, as written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: StatusValue | list[StatusValue] | None = None
    path: str | None = Field(default=None, min_length=1, max_length=500)
    equals: str | bool | int | float | None = None
    present: bool | None = None
    outcome: Outcome
    reason: str | None = Field(default=None, pattern=r"^[a-z0-9_]{1,40}$")
    code: str | None = Field(default=None, min_length=1, max_length=500)
    version: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("path", "code", "version")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_path(value)
        return value

    @field_validator("status")
    @classmethod
    def _statuses(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one status (or leave status out: any status)")
        return value

    @model_validator(mode="after")
    def _shape(self) -> AnswerRule:
        if self.path is None and self.status is None:
            raise ValueError("a rule needs a status, a path, or both")
        tests = (self.equals is not None) + (self.present is not None)
        if self.path is not None and tests != 1:
            raise ValueError("a rule with a path needs exactly one of equals or present")
        if self.path is None and tests:
            raise ValueError("equals and present test the value at a path: add a path")
        if self.version is not None and self.outcome is not Outcome.TRANSIENT:
            raise ValueError("version (retry at once with the version the answer names) "
                             "goes with outcome 'transient'")
        return self


@dataclass(frozen=True)
class _Rule:
    statuses: frozenset[int] | None  # None: any status
    steps: tuple[Step, ...] | None
    equals: Any
    present: bool | None
    outcome: Outcome
    reason: str
    code: tuple[Step, ...] | None
    version: tuple[Step, ...] | None

    def matches(self, status: int, document: Any) -> bool:
        if self.statuses is not None and status not in self.statuses:
            return False
        if self.steps is None:
            return True
        if document is NOT_JSON:
            return False
        found = values_at(document, self.steps)
        if self.present is not None:
            return any(v is not None for v in found) is self.present
        return any(same_json(v, self.equals) for v in found)

    def verdict(self, status: int, document: Any) -> Classified:
        reason = f"http_{status}:{self.reason}"
        if self.code is not None:
            codes = [c for v in values_at(document, self.code) if (c := code_of(v))]
            reason += f":{codes[0]}" if codes else ":no_code"
        version = None
        if self.version is not None:
            # a version goes into a URL: `.` and `..` are code-like but no path segment
            versions = [c for v in values_at(document, self.version)
                        if (c := code_of(v)) and c not in (".", "..")]
            version = versions[0] if versions else None
            if version is None:
                reason += ":no_version"  # retried after the backoff like any transient
        return Classified(self.outcome, reason, version=version)


def _status_set(value: StatusValue | list[StatusValue] | None) -> frozenset[int] | None:
    if value is None:
        return None
    statuses: set[int] = set()
    for entry in value if isinstance(value, list) else [value]:
        if isinstance(entry, str):
            first = int(entry[0]) * 100
            statuses.update(range(first, first + 100))
        else:
            statuses.add(entry)
    return frozenset(statuses)


class Reading(NamedTuple):
    """What a policy's rules read in an answer: the first matching rule's verdict (None:
    the status table decides), the costs it names (None: the policy reads none), and for
    a batch the ids of the objects it says failed (None: it names none)."""

    verdict: Classified | None
    costs: Costs | None = None
    failed: frozenset[str] | None = None


@dataclass(frozen=True)
class Costs:
    """What an answer says of the upstream's cost budget (points; None: not said)."""

    actual: float | None
    available: float | None


def number_at(document: Any, steps: tuple[Step, ...] | None) -> float | None:
    """The first finite, non-negative number the path reaches that a float holds, else
    None (JSON integers have no bound: a 400-digit one overflows a float)."""
    if steps is None:
        return None
    for value in values_at(document, steps):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                continue
            if math.isfinite(number) and number >= 0:
                return number
    return None


_UNPARSED: Final = object()


class _Document:
    """A body parsed at most once, and only when a path asks (a JSON `null` is parsed)."""

    def __init__(self, body: bytes | None) -> None:
        self._body = body
        self._parsed: Any = _UNPARSED

    def get(self) -> Any:
        if self._parsed is _UNPARSED:
            self._parsed = NOT_JSON if self._body is None else read_json(self._body)
        return self._parsed


@dataclass(frozen=True)
class AnswerRules:
    """A policy's rules and cost paths, compiled. `body_statuses` are the statuses whose
    body some rule reads (None: every status); others are never read."""

    rules: tuple[_Rule, ...]
    max_bytes: int
    body_statuses: frozenset[int] | None
    actual_cost: tuple[Step, ...] | None = None
    available_cost: tuple[Step, ...] | None = None
    failed_ids: tuple[Step, ...] | None = None

    def wants_body(self, status: int) -> bool:
        return self.body_statuses is None or status in self.body_statuses

    @property
    def reads_nothing(self) -> bool:
        """No rule and no path: every answer goes to the status table as it is."""
        return not self.rules and self.body_statuses is not None

    def classify(self, status: int, body: bytes | None) -> Classified | None:
        """The first matching rule's verdict, or None (the status table decides)."""
        return self.read(status, body)[0]

    def read(self, status: int, body: bytes | None) -> Reading:
        """What the rules read in an answer (`body` None: not read, too long or not
        wanted). A throttle's wait is the answer's Retry-After, which `outcomes.classify`
        adds."""
        document = _Document(body)
        verdict = None
        for rule in self.rules:
            if rule.matches(status, document.get() if rule.steps is not None else None):
                needs = rule.code is not None or rule.version is not None
                verdict = rule.verdict(status, document.get() if needs else None)
                break
        costs = failed = None
        if self.actual_cost is not None or self.available_cost is not None:
            costs = Costs(number_at(document.get(), self.actual_cost),
                          number_at(document.get(), self.available_cost))
        if self.failed_ids is not None:
            # ids as the answer writes them, strings or numbers, compared as text
            failed = frozenset(str(v) for v in values_at(document.get(), self.failed_ids)
                               if isinstance(v, (str, int)) and not isinstance(v, bool))
        return Reading(verdict, costs, failed)


NO_RULES: Final = AnswerRules(rules=(), max_bytes=DEFAULT_MAX_BYTES, body_statuses=frozenset())
NOTHING_READ: Final = Reading(None)


def compile_rules(rules: Sequence[AnswerRule], max_bytes: int = DEFAULT_MAX_BYTES, *,
                  actual_cost: str | None = None, available_cost: str | None = None,
                  failed_ids: str | None = None) -> AnswerRules:
    """Compile validated rules and the cost and failed-ids paths (parsed once, statuses
    expanded)."""
    compiled = tuple(_Rule(
        statuses=_status_set(r.status),
        steps=parse_path(r.path) if r.path is not None else None,
        equals=r.equals, present=r.present, outcome=r.outcome,
        reason=r.reason or f"rule{n}",
        code=parse_path(r.code) if r.code is not None else None,
        version=parse_path(r.version) if r.version is not None else None)
        for n, r in enumerate(rules, start=1))
    body_statuses: frozenset[int] | None = frozenset()
    if actual_cost is not None or available_cost is not None or failed_ids is not None:
        body_statuses = None  # every answer may say what it cost, or which objects failed
    for rule in compiled:
        if body_statuses is None:
            break
        if rule.steps is None and rule.code is None and rule.version is None:
            continue
        if rule.statuses is None:
            body_statuses = None
        else:
            body_statuses |= rule.statuses
    return AnswerRules(rules=compiled, max_bytes=max_bytes, body_statuses=body_statuses,
                       actual_cost=parse_path(actual_cost) if actual_cost else None,
                       available_cost=parse_path(available_cost) if available_cost else None,
                       failed_ids=parse_path(failed_ids) if failed_ids else None)
