"""What a long-running command does to its heap before it serves (service/commands/startup.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from service.commands.startup import YOUNG_COLLECTION, settle_heap


@pytest.fixture
def heap() -> Iterator[None]:
    """The test process's collector settings, put back afterwards."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_settling_freezes_start_up_and_collects_the_young_less_often(heap: None) -> None:
    gc.unfreeze()
    gc.set_threshold(700, 9, 8)
    settle_heap()
    # what start-up built is out of the collector's passes; the older generations keep theirs
    assert gc.get_freeze_count() > 10_000
    assert gc.get_threshold() == (YOUNG_COLLECTION, 9, 8)
