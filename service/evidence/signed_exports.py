"""Verification of signed evidence: the signature check shared by every export format, and
run exports made before the evidence log (format sweeper-evidence/1).

Exports are now slices of the evidence log (service/evidence/chain.py writes it,
service/evidence/export_slices.py exports and verifies it). A sweeper-evidence/1 export, as
`GET /v1/runs/{id}/evidence` answered before revision 0019, is JSON lines: each record line
carries the run's id and `prev`, the SHA-256 of the previous line's bytes (the first line's
`prev` is the run's genesis digest), and the last line is a manifest (format, run, record
count, last digest, export time, key id) with an Ed25519 signature over its canonical JSON.
`verify` still checks such files; the chain there was computed at export, so it proves only
that the file is what the server signed then.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from cryptography.exceptions import InvalidSignature

from service.config.signing_keys import PublicKey, b64decode, signed_bytes

log = logging.getLogger(__name__)


FORMAT: Final = "sweeper-evidence/1"


def digest(line: bytes) -> str:
    """SHA-256 of one line's bytes (without its line break), hex."""
    return hashlib.sha256(line).hexdigest()


def genesis(run_id: int) -> str:
    """The `prev` of a run's first record line."""
    return digest(f"{FORMAT} run {run_id}".encode())


class VerificationFailed(Exception):
    """The export is not what was signed; `line` is the first line that fails (1-based)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason


def check_signed(where: int, what: str, statement: Mapping[str, Any], signature: object,
                 by_id: Mapping[str, PublicKey]) -> None:
    """`statement` (a manifest or a checkpoint, naming its `key_id`) carries a signature
    that verifies under one of the published keys; VerificationFailed at line `where`."""
    named = statement.get("key_id")
    if named is None or signature is None:
        raise VerificationFailed(where, f"{what} is not signed (the server had no signing "
                                        f"key)")
    key = by_id.get(str(named))
    if key is None:
        raise VerificationFailed(where, f"{what} is signed with key {named}, which is not "
                                        f"among the public keys given "
                                        f"({', '.join(sorted(by_id)) or 'none'})")
    raw = b64decode(signature) if isinstance(signature, str) else None
    try:
        if raw is None:
            raise InvalidSignature
        key.key.verify(raw, signed_bytes(statement))
    except InvalidSignature:
        raise VerificationFailed(where, f"{what}'s signature does not verify under key "
                                        f"{named}: it was changed or signed by another "
                                        f"key") from None


class ExportLines:
    """An export's lines before its manifest, each as (number, its bytes without the line
    break, its JSON object); the manifest line, which must be the last, is kept in
    `manifest` and `signature`. VerificationFailed for a line that is no JSON object, or
    one after the manifest."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = lines
        self.number = 0  # the last line read
        self.manifest: dict[str, Any] | None = None
        self.signature: object = None

    def __iter__(self) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
        for number, raw in enumerate(self._lines, 1):
            self.number = number
            line = raw[:-1] if raw.endswith(b"\n") else raw
            if self.manifest is not None:
                raise VerificationFailed(number, "a line after the manifest")
            try:
                obj = json.loads(line)
            except ValueError:
                raise VerificationFailed(number, "not a JSON line") from None
            if not isinstance(obj, dict):
                raise VerificationFailed(number, "not a JSON object")
            if "manifest" in obj:
                if not isinstance(obj["manifest"], dict):
                    raise VerificationFailed(number, "a manifest that is not an object")
                self.manifest, self.signature = obj["manifest"], obj.get("signature")
                continue
            yield number, line, obj

    def last_manifest(self) -> dict[str, Any]:
        """The manifest, once every line was read; VerificationFailed when there was none."""
        if self.manifest is None:
            raise VerificationFailed(self.number + 1,
                                     "missing: the export ends without its manifest")
        return self.manifest


@dataclass(frozen=True)
class Verified:
    run_id: int
    records: int
    key_id: str


def verify(lines: Iterable[bytes], keys: Iterable[PublicKey]) -> Verified:
    """Check an export line by line against the chain and the manifest's signature under
    any of `keys`. VerificationFailed names the first line that fails."""
    by_id = {k.key_id: k for k in keys}
    export = ExportLines(lines)
    run_id, last, records = _chained_records(export)
    manifest = export.last_manifest()
    where = export.number
    if run_id is None:  # an export with no records
        if not isinstance(manifest.get("run_id"), int):
            raise VerificationFailed(where, "a manifest without its run_id")
        run_id, last = manifest["run_id"], genesis(manifest["run_id"])
    # what the manifest must say of the records before it, each with why it would not
    for name, wanted, problem in (
            ("format", FORMAT, f"the manifest's format is not {FORMAT}"),
            ("run_id", run_id, "the manifest names another run"),
            ("records", records, f"the manifest counts {manifest.get('records')} records, "
                                 f"the export holds {records}"),
            ("last", last, "the manifest's last digest is not the last record's: records "
                           "were changed or dropped at the end")):
        if manifest.get(name) != wanted:
            raise VerificationFailed(where, problem)
    check_signed(where, "the manifest", manifest, export.signature, by_id)
    return Verified(run_id=run_id, records=records, key_id=str(manifest["key_id"]))


def _chained_records(export: ExportLines) -> tuple[int | None, str | None, int]:
    """Every record line read, each of one run and following the line before it: the run
    (None: no records), the last line's digest, the number of records."""
    run_id: int | None = None
    last: str | None = None
    records = 0
    for number, line, obj in export:
        record_run = obj.get("run_id")
        if not isinstance(record_run, int) or isinstance(record_run, bool):
            raise VerificationFailed(number, "a record without its run_id")
        if run_id is None:
            run_id, last = record_run, genesis(record_run)
        elif record_run != run_id:
            raise VerificationFailed(number, f"a record of run {record_run} in run {run_id}'s "
                                             f"export")
        if obj.get("prev") != last:
            raise VerificationFailed(number, (
                "does not follow the line before it (its prev is not that line's digest): "
                "a line before it was changed, dropped, inserted or moved"
                if number > 1 else "is not the first record of its run's export"))
        last = digest(line)
        records += 1
    return run_id, last, records
