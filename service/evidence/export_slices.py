"""Evidence exports as slices of the evidence log, and their offline verification.

An export (`GET /v1/evidence/log`, a range of the log; `GET /v1/runs/{id}/evidence`, the
spans of the log that hold a run's deletions) is JSON lines:

- a checkpoint line, `{"checkpoint": {format, size, head, signed_at, key_id}, "signature"}`,
  opens a slice (size 0 with the genesis head needs no signature);
- then each segment after it (one completion's entries): its entry lines in order,
  `{"seq", <the record>}`, or in a run's export an entry of another run as
  `{"seq", "leaf"}` (its leaf digest only: no other tenant's identifiers), and the line
  closing it, `{"segment": {first, last, hash}}`, the chain after it as stored;
- a stored checkpoint line after the segment whose end it signs; the last closes the
  slice, and the next slice opens with it or a later one (a run's export skips spans
  without its entries);
- the manifest, last: `{"manifest": {format, run_id, after, records, entries, digest,
  next_after, exported_at, key_id}, "signature"}`, `digest` the SHA-256 of every line
  before it.

What `sweeper evidence verify` checks, and what a database writer can and cannot hide:
service/evidence/verification.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.signing_keys import Signer, signed_bytes
from service.evidence import chain
from service.evidence.chain import Checkpoint, Segment
from service.evidence.deletion_records import fields_of, leaf

log = logging.getLogger(__name__)

EXPORT_FORMAT: Final = "sweeper-evidence/2"


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"),
                      default=lambda v: v.isoformat()).encode()


class Slices:
    """Writes one export: checkpoints and entries as they are read, then the manifest."""

    def __init__(self, signer: Signer | None, *, run_id: int | None = None,
                 after: int | None = None) -> None:
        self.signer = signer
        self.run_id = run_id
        self.after = after
        self.records = self.entries = 0
        self._digest = hashlib.sha256()
        self._last_checkpoint: int | None = None

    def _emit(self, line: bytes) -> bytes:
        self._digest.update(line + b"\n")
        return line + b"\n"

    def checkpoint(self, checkpoint: Checkpoint) -> bytes:
        """A checkpoint line (nothing when it repeats the one just written)."""
        if checkpoint.size == self._last_checkpoint:
            return b""
        self._last_checkpoint = checkpoint.size
        return self._emit(checkpoint.line())

    def entry(self, seq: int, record: Mapping[str, Any]) -> bytes:
        """An entry line: the record in full, or only its leaf when this is a run's export
        and the entry is another run's (a stored record that is not one: its bytes)."""
        self.entries += 1
        self._last_checkpoint = None
        if "unreadable" in record:
            return self._emit(_json({"seq": seq, "unreadable": record["unreadable"]}))
        if self.run_id is not None and record["run_id"] != self.run_id:
            return self._emit(_json({"seq": seq, "leaf": leaf(record).hex()}))
        self.records += 1
        return self._emit(_json({"seq": seq, **{name: record[name]
                                               for name, _ in fields_of(record)}}))

    def segment(self, segment: Segment) -> bytes:
        """The line closing a segment's entries: its range and the chain after it."""
        return self._emit(_json({"segment": {"first": segment.seq_start,
                                             "last": segment.seq_end,
                                             "hash": segment.hash.hex()}}))

    def manifest(self, *, next_after: int | None, exported_at: datetime | None = None
                 ) -> bytes:
        """The closing line: what the export holds, signed when a key is configured."""
        manifest = {"format": EXPORT_FORMAT, "run_id": self.run_id, "after": self.after,
                    "records": self.records, "entries": self.entries,
                    "digest": self._digest.hexdigest(), "next_after": next_after,
                    "exported_at": (exported_at or datetime.now(UTC)).isoformat(),
                    "key_id": self.signer.current.key_id if self.signer else None}
        signature = (self.signer.sign(signed_bytes(manifest))
                     if self.signer else None)
        return _json({"manifest": manifest, "signature": signature}) + b"\n"


async def _span_lines(engine: AsyncEngine, slices: Slices, start: Checkpoint,
                      end: Checkpoint) -> AsyncIterator[bytes]:
    """A slice: its opening checkpoint, then its segments, each closed by its hash, with
    every stored checkpoint among them after the segment it ends (each one a verifier
    checks the chain against), the last being `end`."""
    inner = await chain.checkpoints(engine, after=start.size, until=end.size,
                                    limit=end.size - start.size)
    inner.reverse()  # popped from the end, oldest first
    opening = slices.checkpoint(start)  # sent with the first page, not as a chunk alone
    async for page in chain.segments(engine, start.size, end.size):
        chunk: list[bytes] = [opening]
        opening = b""
        for segment in page:
            chunk.extend(slices.entry(segment.seq_start + n, record)
                         for n, record in enumerate(segment.records))
            chunk.append(slices.segment(segment))
            while inner and inner[-1].size <= segment.seq_end:
                chunk.append(slices.checkpoint(inner.pop()))
        yield b"".join(chunk)
    yield opening + slices.checkpoint(end)


async def _guarded(chunks: AsyncIterator[bytes], slices: Slices, **where: int
                   ) -> AsyncIterator[bytes]:
    """Pass the chunks on; a read that fails part way is logged with how far it got and
    propagates (the server then ends the body without its last chunk: the client sees an
    incomplete answer, never a clean short one)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        log.warning("evidence read failed part way", extra={
            **where, "entries_sent": slices.entries, "error_type": type(exc).__name__})
        raise


async def run_export(engine: AsyncEngine, signer: Signer | None, run_id: int
                     ) -> AsyncIterator[bytes]:
    """A run's export: every span between checkpoints that holds one of its deletions
    (the head is checkpointed first, so every deletion so far is in one)."""
    await chain.checkpoint(engine, signer, at_head=True)
    spans = await chain.run_spans(engine, run_id)
    slices = Slices(signer, run_id=run_id)

    async def lines() -> AsyncIterator[bytes]:
        for start, end in spans:
            async for chunk in _guarded(_span_lines(engine, slices, start, end), slices,
                                        run_id=run_id):
                yield chunk
        yield slices.manifest(next_after=None)

    return lines()


async def range_export(engine: AsyncEngine, signer: Signer | None, *, after: int, limit: int
                       ) -> tuple[AsyncIterator[bytes], int | None]:
    """Entries after+1 .. after+limit of the log, widened to the checkpoints around them
    (at most CHECKPOINT_RECORDS more on each side), and where the next page starts (None:
    this one reaches the last checkpoint)."""
    await chain.checkpoint(engine, signer, at_head=True)
    span = await chain.span_for_range(engine, after, limit)
    slices = Slices(signer, after=after)
    next_after = span[1].size if span is not None and span[1].size < span[2] else None

    async def lines() -> AsyncIterator[bytes]:
        if span is not None:
            async for chunk in _guarded(_span_lines(engine, slices, span[0], span[1]),
                                        slices, after=after):
                yield chunk
        yield slices.manifest(next_after=next_after)

    return lines(), next_after
