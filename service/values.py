"""`value`: the class decorator of the small immutable records built for every item (a lease,
an answer, its classification, the plan, the call's result, the completion).

A frozen dataclass sets each field through `object.__setattr__` in its `__init__`: about
2 us to build one of fifteen fields, six of them an item, a tenth of the worker's CPU per
item (bench/reports/2026-12-05-item-cost). A `value` is a dataclass with slots, hashed and
compared by its fields like a frozen one, built with plain attribute stores; the type
checker treats it as frozen (dataclass_transform's frozen_default), so `mypy --strict`
refuses any assignment to its fields where a frozen dataclass raised at run time.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True)
def value(cls: type[T]) -> type[T]:
    """A dataclass with slots, equality and a hash over its fields, read-only to mypy."""
    return dataclasses.dataclass(slots=True, unsafe_hash=True)(cls)
