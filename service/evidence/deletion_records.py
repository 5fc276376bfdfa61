"""One deletion's evidence record: its fields, its canonical bytes, and the hashes over them.

The canonical bytes are what the log stores and what its chain hashes, built the same way
in the database (`canonical_sql`, inside the completion statement) and here (`canonical`,
by the verifier from an export's JSON): the record's format, then each of its fields on
its own line: an integer in decimal, a null as nothing, a text as its UTF-8 length, a
colon and the text, an absent optional text as nothing (so no byte of one field can pass
for another's: the encoding is injective whatever the ids hold), a time as microseconds
since 1970 UTC, a flag as 1 or 0. Identifiers and classified outcomes only, never a payload.

Three record formats, told apart by their first line (so by their bytes and their leaf):
FORMAT's records (RECORD_FIELDS_V1, written before confirmation reads existed),
"sweeper-evidence-record/2" (RECORD_FIELDS_V2: the same fields, then `confirmed`, whether a
read found the object absent after its deletion, written before regions existed) and
RECORD_FORMAT's (RECORD_FIELDS: those, then `region`, the region of the worker that deleted
it, null for a worker serving the tenants pinned nowhere: service/config/regions.py). The
log itself (its genesis, its checkpoints) keeps FORMAT, so every export written before
verifies as it did; an export's record carries `confirmed` from format 2 on and `region`
exactly when it is of format 3.

    leaf = SHA-256(canonical bytes)
    segment hash = SHA-256(hash before the segment || leaf of each entry, in order)

A segment is one completion's entries; the hash before the log's first is GENESIS.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

FORMAT: Final = "sweeper-evidence-log/1"  # the log's, and its first records'
GENESIS: Final = hashlib.sha256(f"{FORMAT} genesis".encode()).digest()  # as 0019 stores it
RECORD_FORMAT_V2: Final = "sweeper-evidence-record/2"  # the records written 0023-0028
RECORD_FORMAT: Final = "sweeper-evidence-record/3"  # the records written since 0029

# A record, in its canonical order: name and kind ("int", "int?", "text", "time", "flag").
RECORD_FIELDS_V1: Final = (
    ("item_id", "int"), ("run_id", "int?"), ("released_by", "text"), ("tenant_id", "text"),
    ("object_id", "text"), ("policy", "text"), ("policy_version", "int"),
    ("operation_key", "text"), ("outcome", "text"), ("upstream_status", "int?"),
    ("attempts", "int"), ("completed_at", "time"),
)
RECORD_FIELDS_V2: Final = (*RECORD_FIELDS_V1, ("confirmed", "flag"))
RECORD_FIELDS: Final = (*RECORD_FIELDS_V2, ("region", "text?"))
# each record format's first line and fields
_FORMATS: Final = ((RECORD_FORMAT, RECORD_FIELDS), (RECORD_FORMAT_V2, RECORD_FIELDS_V2),
                   (FORMAT, RECORD_FIELDS_V1))
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND: Final = timedelta(microseconds=1)
FRAME_BYTES: Final = 4  # each stored record is preceded by its length, big-endian


class RecordProblem(ValueError):
    """A record that has no canonical form, or bytes that are not one."""


def fields_of(record: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The fields of `record`'s format: the newest's exactly when it has `region`, format
    2's when it has `confirmed` but no `region`, else the first's."""
    if "region" in record:
        return RECORD_FIELDS
    return RECORD_FIELDS_V2 if "confirmed" in record else RECORD_FIELDS_V1


def format_of(fields: tuple[tuple[str, str], ...]) -> str:
    """The first line of the records of `fields`' format."""
    return next(name for name, known in _FORMATS if known is fields)


def _flag(value: object) -> str:
    if not isinstance(value, bool):
        raise RecordProblem("not a boolean")
    return "1" if value else "0"


def _time(value: object) -> str:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise RecordProblem("not an ISO 8601 time") from None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise RecordProblem("not a time with its offset")
    return str((value - _EPOCH) // _MICROSECOND)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise RecordProblem("not a string")
    return f"{len(value.encode())}:{value}"


def _int(value: object) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RecordProblem("not an integer")
    return str(value)


def _optional_int(value: object) -> str:
    return "" if value is None else _int(value)


def _optional_text(value: object) -> str:
    return "" if value is None else _text(value)


# Each kind of field's line in the canonical bytes (the module docstring)
_PARTS: Final[Mapping[str, Callable[[object], str]]] = {
    "flag": _flag, "time": _time, "text": _text, "int": _int, "int?": _optional_int,
    "text?": _optional_text,
}


def canonical(record: Mapping[str, Any]) -> bytes:
    """A record's canonical bytes (the module docstring), in the format its fields name."""
    fields = fields_of(record)
    parts = [format_of(fields)]
    for name, kind in fields:
        try:
            parts.append(_PARTS[kind](record[name]))
        except KeyError:
            raise RecordProblem(f"{name}: missing") from None
        except RecordProblem as exc:
            raise RecordProblem(f"{name}: {exc}") from None
    return "\n".join(parts).encode()


def parse(data: bytes) -> dict[str, Any]:
    """The record whose canonical bytes `data` are (`canonical`'s inverse)."""
    found = next(((f"{name}\n".encode(), fields) for name, fields in _FORMATS
                  if data.startswith(f"{name}\n".encode())), None)
    if found is None:
        raise RecordProblem("not a record of a known format")
    prefix, fields = found
    pos, record = len(prefix), dict[str, Any]()
    try:
        for number, (name, kind) in enumerate(fields):
            last = number == len(fields) - 1
            if kind == "text?" and data[pos:pos + 1] in (b"\n", b""):  # a null
                record[name] = None
                end = pos
            elif kind in ("text", "text?"):
                colon = data.index(b":", pos)
                start = colon + 1
                end = start + int(data[pos:colon])
                record[name] = data[start:end].decode()
            else:
                end = len(data) if last else data.index(b"\n", pos)
                raw = data[pos:end].decode()
                if kind == "flag" and raw not in ("0", "1"):
                    raise RecordProblem(f"{name}: not 0 or 1")
                record[name] = (None if kind == "int?" and raw == "" else
                                _EPOCH + int(raw) * _MICROSECOND if kind == "time" else
                                raw == "1" if kind == "flag" else int(raw))
            pos = end
            if not last:
                if data[pos:pos + 1] != b"\n":
                    raise RecordProblem(f"{name}: not followed by a line break")
                pos += 1
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordProblem(f"not a record: {exc}") from None
    if pos != len(data) or canonical(record) != data:
        raise RecordProblem("not a record in its canonical form")
    return record


def frames(stored: bytes) -> list[bytes]:
    """A segment's stored records: each record's canonical bytes, in order."""
    out, pos = [], 0
    while pos < len(stored):
        size = int.from_bytes(stored[pos:pos + FRAME_BYTES], "big")
        pos += FRAME_BYTES
        if size <= 0 or pos + size > len(stored):
            raise RecordProblem("a stored record's length runs past its segment")
        out.append(stored[pos:pos + size])
        pos += size
    return out


def leaf(record: Mapping[str, Any]) -> bytes:
    """The SHA-256 of a record's canonical bytes."""
    return hashlib.sha256(canonical(record)).digest()


def segment_hash(before: bytes, leaves: Iterable[bytes]) -> bytes:
    """The chain after a segment, from the chain before it and its entries' leaves."""
    return hashlib.sha256(before + b"".join(leaves)).digest()


def canonical_sql(row: str) -> str:
    """SQL for the canonical bytes (bytea) of the record, in RECORD_FORMAT, whose columns,
    named as RECORD_FIELDS, `row` names: byte for byte `canonical` (extract(epoch) is an
    exact numeric from PostgreSQL 14)."""
    parts = [f"'{RECORD_FORMAT}'"]
    for name, kind in RECORD_FIELDS:
        column = f"{row}.{name}"
        parts.append({
            "int": f"{column}::text",
            "int?": f"coalesce({column}::text, '')",
            "text": f"octet_length({column})::text || ':' || {column}",
            "text?": f"coalesce(octet_length({column})::text || ':' || {column}, '')",
            "time": f"trunc(extract(epoch FROM {column}) * 1000000)::bigint::text",
            "flag": f"CASE WHEN {column} THEN '1' ELSE '0' END",
        }[kind])
    return f"convert_to(concat_ws(E'\\n', {', '.join(parts)}), 'UTF8')"
