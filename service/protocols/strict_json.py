"""JSON read strictly, where Sweeper reads JSON it did not write and a guess would change
what it does: an operator request's body (service/http/api/bodies.py) and a policy's request
body (service/config/request_templates.py)."""

from __future__ import annotations

import json
import math
from typing import Any


class NotJson(ValueError):
    """Text Python's reader takes that JSON does not say one way; the message names why."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        keys = [key for key, _ in pairs]
        twice = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise NotJson(f"the key {twice!r} appears twice in one object")
    return members


def _constant(name: str) -> Any:
    raise NotJson(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf
        raise NotJson(f"the number {text[:32]} is out of range")
    return value


def loads(text: str | bytes) -> Any:
    """The value of JSON text, refusing a key twice in one object (read as its last value,
    `{"dry_run": true, "dry_run": false}` would start a real deletion), NaN and Infinity,
    a number past a double's range or Python's 4,300-digit integers, and nesting deeper
    than Python recurses: NotJson. A syntax error is json.JSONDecodeError; both are
    ValueError."""
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_constant,
                          parse_float=_float)
    except RecursionError:
        raise NotJson("nested too deeply") from None
    except (NotJson, json.JSONDecodeError):
        raise
    except ValueError:  # int() past sys.get_int_max_str_digits()
        raise NotJson("a number has too many digits") from None
