"""What a broker message carries (service/execution/work.py): ledger ids and an origin,
bounded, read strictly; and the fixed delays a deferral rounds up to."""

from __future__ import annotations

import json

import pytest

from service.execution.rabbitmq import WAITS_S, queue_names, wait_for
from service.execution.relay import IDS_PER_MESSAGE, works_of
from service.execution.work import MAX_BODY_BYTES, MAX_IDS, BadWork, Work


def test_work_round_trips_through_its_body() -> None:
    work = Work.of("batch:42", [3, 1, 2, 3])
    assert work.item_ids == (1, 2, 3)
    assert json.loads(work.encode()) == {"v": 1, "origin": "batch:42", "items": [1, 2, 3]}
    assert Work.decode(work.encode()) == work
    assert work.part([2]) == Work("batch:42", (2,))


@pytest.mark.parametrize(("body", "why"), [
    (b"not json", "not JSON"),
    (b'{"v": 1, "origin": "batch:1", "items": [1], "tenant": "acme"}', "{v, origin, items}"),
    (b'{"v": 2, "origin": "batch:1", "items": [1]}', "version"),
    (b'{"v": 1, "origin": "acme:1", "items": [1]}', "origin"),
    (b'{"v": 1, "origin": "batch:01", "items": [1]}', "origin"),
    (b'{"v": 1, "origin": "batch:1", "items": []}', "1 to"),
    (b'{"v": 1, "origin": "batch:1", "items": [true]}', "integers"),
    (b'{"v": 1, "origin": "batch:1", "items": [1.0]}', "integers"),
    (b'{"v": 1, "origin": "batch:1", "items": ["cart-1"]}', "integers"),
    (b'{"v": 1, "origin": "batch:1", "items": [0]}', "positive"),
    (b'{"v": 1, "origin": "batch:1", "items": [9223372036854775808]}', "positive"),
    (b'{"v": 1, "origin": "batch:1", "items": [2, 1]}', "ascending"),
    (b'{"v": 1, "origin": "batch:1", "items": [1, 1]}', "ascending"),
    (b'{"v": 1, "v": 1, "origin": "batch:1", "items": [1]}', "JSON"),
])
def test_anything_else_is_refused_without_quoting_it(body: bytes, why: str) -> None:
    with pytest.raises(BadWork, match=why) as caught:
        Work.decode(body)
    assert "cart" not in str(caught.value) and "acme" not in str(caught.value)


def test_the_largest_work_fits_its_body_bound() -> None:
    largest = Work.of("receipt:9223372036854775807",
                      range(2**63 - MAX_IDS, 2**63))
    assert len(largest.encode()) <= MAX_BODY_BYTES
    with pytest.raises(BadWork, match="larger"):
        Work.decode(b" " * (MAX_BODY_BYTES + 1))
    with pytest.raises(BadWork, match="1 to"):
        Work.of("batch:1", list(range(1, MAX_IDS + 2)))


def test_an_outbox_row_goes_as_messages_of_at_most_ids_per_message() -> None:
    works = works_of("batch", 7, list(range(1, 2 * IDS_PER_MESSAGE + 3)))
    assert [len(w.item_ids) for w in works] == [IDS_PER_MESSAGE, IDS_PER_MESSAGE, 2]
    assert {w.origin for w in works} == {"batch:7"}
    assert works_of("batch", 8, []) == []


def test_a_deferral_rounds_up_to_a_fixed_delay() -> None:
    assert [wait_for(s) for s in (0, 0.5, 1, 1.01, 29, 31, 10_000)] == [1, 1, 1, 2, 30, 60, 300]
    assert max(WAITS_S) == 300
    assert queue_names("eu")["work"] == "sweeper.eu.work"
    assert queue_names(None)["wait.5"] == "sweeper.wait.5s"
