"""The evidence log: every deletion, chained as it is written, under signed checkpoints.

What is promised. Every item that reaches `succeeded`, whatever released it (a run's batch,
a webhook hint, a re-drive, a store target, a list source), is appended to `evidence_log`
by the completion statement that records its outcome (completions._COMPLETE): same statement,
same transaction, so an outcome is never committed without its entry. An entry is a
record of identifiers and classified outcomes (service/evidence/deletion_records.py), never a
payload. Entries are numbered `seq` = 1, 2, ... with no gap; each completion appends its
entries as one *segment* row (seq_start .. seq_end) holding their canonical bytes and the
chain after it (a row per completion, not per entry: bench/reports/design-notes.md,
Evidence):

    hash(segment) = SHA-256(hash(segment before) || leaf(seq_start) || .. || leaf(seq_end))
    leaf = SHA-256(an entry's canonical bytes),   the hash before the first: GENESIS

The completion locks the one `evidence_log_head` row (size, last hash) after its items
are updated, appends under it and moves it, so appends are serialised and the log has one
order. Checkpoints (`evidence_checkpoints`) are Ed25519 signatures, with the evidence
signing key, over (format, log size, head hash, signed_at from the database clock, key
id), as Certificate Transparency and Rekor publish signed tree heads, each at a segment's
end: at the first segment end past every CHECKPOINT_RECORDS entries, at the head every
CHECKPOINT_INTERVAL_S when the log grew, and at the head before each export. Exports
(service/evidence/export_slices.py) are slices of the log between checkpoints.

What `sweeper evidence verify` checks, and so what an attacker with write access to the
database can and cannot do: service/evidence/verification.py's docstring.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.signing_keys import Signer, signed_bytes
from service.db.statements import Statement, fetch, fetch_none
from service.evidence.deletion_records import FORMAT, GENESIS, RecordProblem, frames, parse
from service.observability.failures import repeat

log = logging.getLogger(__name__)

# A checkpoint at the first segment end past every this many entries, whatever the time: a
# slice between two checkpoints (what an export must carry to prove one entry) is at most
# this long and one completion's entries.
CHECKPOINT_RECORDS: Final = 1024
# And one at the head at this interval when the log grew: how long an entry can wait
# for a signature (and the window an operator's copy of the checkpoints can lag by).
CHECKPOINT_INTERVAL_S: Final = 60.0
# Segments read per statement when an export streams the log (a segment is one
# completion's entries: a few hundred at most).
PAGE_SEGMENTS: Final = 8
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


# -- checkpoints ----------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    """A signed statement of the log's size and head hash at a time."""

    size: int
    head: bytes
    signed_at: datetime
    key_id: str | None
    signature: str | None

    def statement(self) -> dict[str, Any]:
        """What the signature covers (canonical JSON of this)."""
        return checkpoint_statement(self.size, self.head.hex(), self.signed_at.isoformat(),
                                    self.key_id)

    def line(self) -> bytes:
        """The checkpoint as an export line."""
        return json.dumps({"checkpoint": self.statement(), "signature": self.signature},
                          separators=(",", ":")).encode()


def checkpoint_statement(size: int, head_hex: str, signed_at: str, key_id: str | None
                         ) -> dict[str, Any]:
    """The signed part of a checkpoint."""
    return {"format": FORMAT, "size": size, "head": head_hex, "signed_at": signed_at,
            "key_id": key_id}


GENESIS_CHECKPOINT: Final = Checkpoint(0, GENESIS, _EPOCH, None, None)

# The sizes due a checkpoint: each segment end past the last checkpoint that is the first
# past a multiple of CHECKPOINT_RECORDS, and the head when it is past the last checkpoint
# and either :at_head or the last checkpoint is older than :interval_s; with the chain
# after each, and the time. Nothing past the head (a row written around the completion
# statement is no segment of the log).
_DUE = Statement("chain.due", (
    "The log sizes due a checkpoint (a segment end past every CHECKPOINT_RECORDS entries, "
    "and the head when asked or when the last is older than the interval), with their "
    "hashes and the time."), f"""
    WITH last AS (
        SELECT coalesce(max(size), 0) AS size,
               coalesce(max(signed_at), '-infinity') AS at FROM evidence_checkpoints
    ),
    head AS (SELECT size, hash FROM evidence_log_head WHERE id = 1),
    due AS (
        SELECT s.seq_end AS size, s.hash FROM evidence_log s, last, head
        WHERE s.seq_end > last.size AND s.seq_end < head.size
          AND s.seq_end / {CHECKPOINT_RECORDS} > (s.seq_start - 1) / {CHECKPOINT_RECORDS}
        UNION
        SELECT head.size, head.hash FROM last, head
        WHERE head.size > last.size
          AND (CAST(:at_head AS boolean)
               OR last.at <= now() - make_interval(secs => :interval_s)
               OR head.size / {CHECKPOINT_RECORDS} > last.size / {CHECKPOINT_RECORDS})
    )
    SELECT size, hash, now() AS signed_at FROM due ORDER BY size
""")  # noqa: S608 - only constants are interpolated

_RECORD = Statement("chain.record_checkpoints", (
    "Store signed checkpoints; a size another replica signed first keeps its own."), """
    INSERT INTO evidence_checkpoints (size, hash, signed_at, key_id, signature)
    SELECT * FROM unnest(CAST(:sizes AS bigint[]), CAST(:hashes AS bytea[]),
                         CAST(:times AS timestamptz[]), CAST(:keys AS text[]),
                         CAST(:signatures AS text[]))
    ON CONFLICT (size) DO NOTHING
""")


# Checkpoints stored while no key was configured, to be signed once one is.
_UNSIGNED = Statement("chain.unsigned", (
    "Checkpoints stored without a signature, oldest first, at most :limit."), """
    SELECT size, hash, signed_at FROM evidence_checkpoints
    WHERE signature IS NULL ORDER BY size LIMIT :limit
""")

_SIGN = Statement("chain.sign_checkpoints", (
    "Sign checkpoints stored unsigned (one no other replica signed meanwhile)."), """
    UPDATE evidence_checkpoints c SET key_id = s.key_id, signature = s.signature
    FROM unnest(CAST(:sizes AS bigint[]), CAST(:keys AS text[]), CAST(:signatures AS text[]))
         AS s(size, key_id, signature)
    WHERE c.size = s.size AND c.signature IS NULL
""")

# Unsigned checkpoints signed per pass once a key is configured.
SIGN_BATCH: Final = 1000


async def checkpoint(engine: AsyncEngine, signer: Signer | None, *, at_head: bool,
                     interval_s: float = CHECKPOINT_INTERVAL_S) -> int:
    """Sign and store the checkpoints due now (see _DUE; `at_head`: the head's too, as an
    export needs). Unsigned when no key is configured (verification then says so); with a
    key, checkpoints stored unsigned before are signed as they stand (such a signature
    says what the log held when the key came, not before). Returns how many were stored."""
    key_id = signer.current.key_id if signer else None
    if signer is not None:
        unsigned = [Checkpoint(int(r.size), bytes(r.hash), r.signed_at, key_id, None)
                    for r in await fetch(engine, _UNSIGNED, {"limit": SIGN_BATCH})]
        if unsigned:
            await fetch_none(engine, _SIGN, {
                "sizes": [c.size for c in unsigned], "keys": [key_id] * len(unsigned),
                "signatures": [signer.sign(signed_bytes(c.statement())) for c in unsigned]})
    due = await fetch(engine, _DUE, {"at_head": at_head, "interval_s": interval_s})
    if not due:
        return 0
    made = [Checkpoint(int(r.size), bytes(r.hash), r.signed_at, key_id, None) for r in due]
    signatures = [signer.sign(signed_bytes(c.statement())) if signer else None for c in made]
    await fetch_none(engine, _RECORD, {
        "sizes": [c.size for c in made], "hashes": [c.head for c in made],
        "times": [c.signed_at for c in made], "keys": [key_id] * len(made),
        "signatures": signatures})
    return len(made)


async def checkpoint_loop(engine: AsyncEngine, signer: Signer | None, *,
                          interval_s: float = CHECKPOINT_INTERVAL_S) -> None:
    """Make the due checkpoints every `interval_s` until cancelled (outages retried)."""
    await repeat(lambda: checkpoint(engine, signer, at_head=False, interval_s=interval_s),
                 every_s=interval_s, what="evidence checkpoints", logger=log)


_CHECKPOINTS = Statement("chain.checkpoints", (
    "Stored checkpoints past a size (and up to another), oldest first, at most :limit."), """
    SELECT size, hash, signed_at, key_id, signature FROM evidence_checkpoints
    WHERE size > :after AND size <= :until ORDER BY size LIMIT :limit
""")


async def checkpoints(engine: AsyncEngine, *, after: int, limit: int,
                      until: int = 2**63 - 1) -> list[Checkpoint]:
    """Stored checkpoints with a size past `after` and at most `until`, oldest first."""
    rows = await fetch(engine, _CHECKPOINTS, {"after": after, "until": until,
                                              "limit": limit})
    return [_checkpoint(r) for r in rows]


# -- reading slices -------------------------------------------------------------------

_AROUND = Statement("chain.around", (
    "The checkpoints a range of the log is read between: the last at or before :after, "
    "the first at or past :until, and the last there is."), """
    (SELECT 'start' AS side, * FROM evidence_checkpoints WHERE size <= :after
     ORDER BY size DESC LIMIT 1)
    UNION ALL
    (SELECT 'end', * FROM evidence_checkpoints WHERE size >= :until
     ORDER BY size LIMIT 1)
    UNION ALL
    (SELECT 'last', * FROM evidence_checkpoints ORDER BY size DESC LIMIT 1)
""")

_SPANS = Statement("chain.run_spans", (
    "The spans between consecutive checkpoints that hold entries of a run, oldest first."),
    """
    WITH mine AS (SELECT seq_end FROM evidence_log WHERE runs @> ARRAY[CAST(:run AS bigint)]),
    spans AS (
        SELECT DISTINCT
               (SELECT max(c.size) FROM evidence_checkpoints c WHERE c.size < m.seq_end)
                   AS after,
               (SELECT min(c.size) FROM evidence_checkpoints c WHERE c.size >= m.seq_end)
                   AS size
        FROM mine m
    )
    SELECT coalesce(after, 0) AS after, size FROM spans
    WHERE size IS NOT NULL
    ORDER BY size
""")

_AT = Statement("chain.checkpoints_at", (
    "The checkpoints of the given sizes."), """
    SELECT size, hash, signed_at, key_id, signature FROM evidence_checkpoints
    WHERE size = ANY(CAST(:sizes AS bigint[])) ORDER BY size
""")

_SEGMENTS = Statement("chain.segments", (
    "One page of the log's segments ending in a seq range, in order."), """
    SELECT seq_start, seq_end, records, hash FROM evidence_log
    WHERE seq_end > :after AND seq_end <= :until
    ORDER BY seq_end LIMIT :page
""")


def _checkpoint(r: Any) -> Checkpoint:
    return Checkpoint(int(r.size), bytes(r.hash), r.signed_at, r.key_id, r.signature)


async def span_for_range(engine: AsyncEngine, after: int, limit: int
                         ) -> tuple[Checkpoint, Checkpoint, int] | None:
    """The checkpoints around entries after+1 .. after+limit: the last at or before
    `after` (genesis if none) and the first at or past after+limit (else the last one),
    and the last checkpoint's size; None when no checkpoint is past `after` (nothing
    there is signed yet)."""
    found = {r.side: _checkpoint(r) for r in await fetch(engine, _AROUND, {
        "after": after, "until": after + limit})}
    last = found.get("last")
    if last is None or last.size <= after:
        return None
    return found.get("start", GENESIS_CHECKPOINT), found.get("end", last), last.size


async def run_spans(engine: AsyncEngine, run_id: int) -> list[tuple[Checkpoint, Checkpoint]]:
    """The (start, end) checkpoint pairs whose span holds entries of the run."""
    spans = [(int(r.after), int(r.size)) for r in await fetch(engine, _SPANS, {"run": run_id})]
    sizes = sorted({s for span in spans for s in span} - {0})
    found = {c.size: c for c in map(_checkpoint, await fetch(engine, _AT, {"sizes": sizes}))}
    found[0] = found.get(0, GENESIS_CHECKPOINT)
    return [(found[a], found[b]) for a, b in spans]


@dataclass(frozen=True)
class Segment:
    """One completion's entries as stored: seq_start .. seq_end, the records, the chain
    after them."""

    seq_start: int
    seq_end: int
    records: list[dict[str, Any]]
    hash: bytes


async def segments(engine: AsyncEngine, after: int, until: int, *,
                   page_segments: int = PAGE_SEGMENTS) -> AsyncIterator[list[Segment]]:
    """The segments ending after `after` and at most at `until`, in order, in pages
    (each its own short read). A stored record that is not one (edited bytes) is passed
    on as its raw bytes under `unreadable`: the verifier's leaf of those bytes then fails."""
    while after < until:
        rows = await fetch(engine, _SEGMENTS, {"after": after, "until": until,
                                               "page": page_segments})
        if not rows:
            return
        page = [Segment(int(r.seq_start), int(r.seq_end), _records(bytes(r.records)),
                        bytes(r.hash)) for r in rows]
        after = page[-1].seq_end
        yield page


def _records(stored: bytes) -> list[dict[str, Any]]:
    try:
        raw = frames(stored)
    except RecordProblem:
        return [{"unreadable": stored.hex()}]
    out = []
    for data in raw:
        try:
            out.append(parse(data))
        except RecordProblem:
            out.append({"unreadable": data.hex()})
    return out
