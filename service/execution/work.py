"""What a broker carries: ledger item ids and the durable identity of where they came from,
nothing else (no object ids, tenant data or credentials: the broker is not an archive of
customer data, and a message read from it names nothing outside the ledger).

A message body is `{"v": 1, "origin": "batch:42", "items": [1, 2, 3]}`. The origin is the
outbox row's identity (a batch, `batch:<id>`; a webhook delivery, `receipt:<id>`; a released
hold, `hold:<id>`; an operator's re-drive, `requeue:<id>`) and is the
AMQP message id: a message published twice (a relay that crashed between the broker's
confirm and its mark) is the same message twice, and the ledger fences the second.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Final

from service.protocols.strict_json import NotJson, loads
from service.values import value

VERSION: Final = 1
# The most ids one message carries: a batch's (SWEEPER_BATCH_SIZE is at most 10,000),
# about 110 KB of JSON at the largest ids.
MAX_IDS: Final = 10_000
MAX_BODY_BYTES: Final = 16 + 22 * MAX_IDS + 256
_ORIGIN = re.compile(r"(batch|receipt|hold|requeue):[1-9][0-9]{0,18}")
MAX_ID: Final = 2**63 - 1  # PostgreSQL's bigint


class BadWork(ValueError):
    """A message that is not Sweeper's work; the text says why (never quoting the body)."""


@value
class Work:
    """Item ids (each at most once, ascending) from one origin."""

    origin: str
    item_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not _ORIGIN.fullmatch(self.origin):
            raise BadWork("the origin is not batch:, receipt:, hold: or requeue:<id>")
        if not 0 < len(self.item_ids) <= MAX_IDS:
            raise BadWork(f"a message carries 1 to {MAX_IDS} item ids")
        if any(not 0 < i <= MAX_ID for i in self.item_ids) or any(
                a >= b for a, b in zip(self.item_ids, self.item_ids[1:], strict=False)):
            raise BadWork("item ids are positive bigints, each once, ascending")

    @classmethod
    def of(cls, origin: str, item_ids: Iterable[int]) -> Work:
        return cls(origin, tuple(sorted(set(item_ids))))

    def part(self, item_ids: Iterable[int]) -> Work:
        """The same origin carrying only `item_ids` (a deferred remainder)."""
        return Work.of(self.origin, item_ids)

    def encode(self) -> bytes:
        return json.dumps({"v": VERSION, "origin": self.origin,
                           "items": list(self.item_ids)}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> Work:
        """The work a message body carries, or BadWork."""
        if len(body) > MAX_BODY_BYTES:
            raise BadWork("the body is larger than any work message")
        try:
            doc = loads(body)
        except (NotJson, ValueError):
            raise BadWork("the body is not JSON") from None
        if not isinstance(doc, dict) or set(doc) != {"v", "origin", "items"}:
            raise BadWork("the body is not {v, origin, items}")
        if doc["v"] != VERSION or not isinstance(doc["origin"], str):
            raise BadWork(f"not version {VERSION} work")
        items = doc["items"]
        if not isinstance(items, list) or not all(
                type(i) is int for i in items):  # a bool is not an id
            raise BadWork("items is not a list of integers")
        return cls(doc["origin"], tuple(items))
