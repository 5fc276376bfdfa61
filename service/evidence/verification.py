"""Offline verification of evidence exports (service/evidence/export_slices.py says their format).

What `sweeper evidence verify` checks (`verify`): every checkpoint's signature under a
published key; each entry's seq follows the one before; each record's leaf, recomputed
from its fields, and the leaves of its segment chained onto the hash before give the
segment's stored hash and, at every checkpoint, that checkpoint's head; no entry outside a
slice closed by a checkpoint; two checkpoints of one size agree; with `--checkpoints`,
every checkpoint the operator kept elsewhere agrees with the log at its size; and the
manifest's counts, digest and signature (so the file itself was not cut or re-mixed).

So, for an attacker with write access to the database but not the signing key: an UPDATE
or DELETE of a stored segment or of entries in it, or a segment inserted, is caught by the
verification of any later export that covers it: its entries no longer hash to what the
signed checkpoint after them states (or to the segment's own stored hash, if that was left
alone). A checkpoint row edited or replaced fails its signature or the chain. Slices of
two exports spliced together fail at the seam or at the manifest. What such an attacker
can do: rewrite the segments after the last checkpoint and let the server sign the
rewritten log, or rewrite everything and delete the checkpoints stored in the database so
the server signs new ones. Neither is caught unless checkpoints are kept outside the
database: operators copy `GET /v1/evidence/checkpoints` to storage the database's writers
cannot change (object storage with a retention lock, another account's bucket, a
transparency service) at least every CHECKPOINT_INTERVAL_S and pass it to `verify
--checkpoints`; then only the entries after the last kept checkpoint can be rewritten
unseen. An attacker with the signing key can sign anything: keep the key off the database
host.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from service.config.signing_keys import PublicKey
from service.evidence import deletion_records
from service.evidence.chain import Checkpoint
from service.evidence.deletion_records import (
    GENESIS,
    RECORD_FIELDS,
    RECORD_FIELDS_V1,
    RECORD_FIELDS_V2,
    RecordProblem,
    leaf,
    segment_hash,
)
from service.evidence.export_slices import EXPORT_FORMAT
from service.evidence.signed_exports import ExportLines, VerificationFailed, check_signed

_HEX64: Final = re.compile(r"[0-9a-f]{64}")
# a record's keys in each record format (deletion_records.py): older exports verify still
_RECORD_KEYS: Final = tuple(frozenset({"seq", *(name for name, _ in fields)})
                            for fields in (RECORD_FIELDS, RECORD_FIELDS_V2, RECORD_FIELDS_V1))
_ELIDED_KEYS: Final = frozenset({"seq", "leaf"})


@dataclass(frozen=True)
class Verified:
    """What a verified export holds."""

    run_id: int | None
    records: int
    entries: int
    checkpoints: int
    first_seq: int | None
    last_seq: int | None
    key_id: str
    next_after: int | None


def read_checkpoint(where: int, obj: Mapping[str, Any], by_id: Mapping[str, PublicKey]
                    ) -> Checkpoint:
    """A checkpoint line's checkpoint, its signature verified (genesis needs none)."""
    statement = obj.get("checkpoint")
    if not isinstance(statement, dict) or set(statement) != {
            "format", "size", "head", "signed_at", "key_id"}:
        raise VerificationFailed(where, "a checkpoint without its fields")
    size, head = statement["size"], statement["head"]
    if (statement["format"] != deletion_records.FORMAT or not isinstance(size, int)
            or isinstance(size, bool) or size < 0 or not isinstance(head, str)
            or not _HEX64.fullmatch(head) or not isinstance(statement["signed_at"], str)):
        raise VerificationFailed(where, "a checkpoint that is not well formed")
    try:
        signed_at = datetime.fromisoformat(statement["signed_at"])
    except ValueError:
        raise VerificationFailed(where, "a checkpoint whose time is not ISO 8601") from None
    if not (size == 0 and head == GENESIS.hex()):
        check_signed(where, f"the checkpoint at size {size}", statement, obj.get("signature"),
                by_id)
    return Checkpoint(size, bytes.fromhex(head), signed_at, statement["key_id"],
                      obj.get("signature"))


def kept_checkpoints(text: bytes, keys: Iterable[PublicKey]) -> dict[int, bytes]:
    """Checkpoints an operator kept outside the database (the JSON of
    `GET /v1/evidence/checkpoints`, or checkpoint lines), each signature verified: size ->
    head. VerificationFailed names the entry that fails (1-based)."""
    by_id = {k.key_id: k for k in keys}
    try:
        doc = json.loads(text)
        items = doc["checkpoints"] if isinstance(doc, dict) else None
    except ValueError:
        items = None
    if not isinstance(items, list):
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            raise VerificationFailed(1, "neither the JSON of GET /v1/evidence/checkpoints "
                                        "nor checkpoint lines") from None
    kept: dict[int, bytes] = {}
    for number, obj in enumerate(items, 1):
        if not isinstance(obj, dict):
            raise VerificationFailed(number, "not a checkpoint")
        checkpoint = read_checkpoint(number, obj, by_id)
        if kept.setdefault(checkpoint.size, checkpoint.head) != checkpoint.head:
            raise VerificationFailed(number, f"two kept checkpoints of size "
                                             f"{checkpoint.size} disagree")
    return kept


class _Chain:
    """The verifier's state along an export: where the log stands after the last segment
    read, the entries read since, and what was counted."""

    def __init__(self, by_id: Mapping[str, PublicKey], kept: Mapping[int, bytes]) -> None:
        self.by_id, self.kept = by_id, kept
        self.size: int | None = None  # None: no checkpoint opened a slice yet
        self.head = b""
        self.leaves: list[bytes] = []  # of the entries since the last segment line
        self.open = False  # a segment read since the last checkpoint
        self.records = self.entries = self.checkpoints = 0
        self.last_checkpoint = -1
        self.first_seq: int | None = None
        self.heads: dict[int, bytes] = {}
        self.runs: set[object] = set()

    def checkpoint(self, number: int, obj: Mapping[str, Any]) -> None:
        cp = read_checkpoint(number, obj, self.by_id)
        if self.heads.setdefault(cp.size, cp.head) != cp.head:
            raise VerificationFailed(number, f"two checkpoints of size {cp.size} disagree: "
                                             f"the log was rewritten")
        if self.kept.get(cp.size, cp.head) != cp.head:
            raise VerificationFailed(number, f"the checkpoint at size {cp.size} is not the "
                                             f"one kept: the log was rewritten")
        if self.leaves:
            raise VerificationFailed(number, "a checkpoint inside a segment")
        if self.open and (cp.size, cp.head) != (self.size, self.head):
            raise VerificationFailed(number, (
                f"the segments since the checkpoint before do not hash to this checkpoint's "
                f"head (size {cp.size}): an entry was changed, dropped or inserted"))
        if cp.size < self.last_checkpoint:
            raise VerificationFailed(number, "a checkpoint older than the one before it")
        self.size, self.head, self.open, self.last_checkpoint = cp.size, cp.head, False, cp.size
        self.checkpoints += 1

    def entry(self, number: int, obj: Mapping[str, Any]) -> None:
        if self.size is None:
            raise VerificationFailed(number, "an entry before any checkpoint")
        seq, expected = obj.get("seq"), self.size + len(self.leaves) + 1
        if seq != expected or isinstance(seq, bool):
            raise VerificationFailed(number, (
                f"entry {seq} where entry {expected} follows: an entry was dropped, inserted "
                f"or moved"))
        if set(obj) == _ELIDED_KEYS:
            if not isinstance(obj["leaf"], str) or not _HEX64.fullmatch(obj["leaf"]):
                raise VerificationFailed(number, "a leaf that is not a SHA-256")
            self.leaves.append(bytes.fromhex(obj["leaf"]))
        elif set(obj) in _RECORD_KEYS:
            try:
                self.leaves.append(leaf(obj))
            except RecordProblem as exc:
                raise VerificationFailed(number, f"not a record: {exc}") from None
            self.records += 1
            self.runs.add(obj["run_id"])
        elif set(obj) == {"seq", "unreadable"}:
            raise VerificationFailed(number, (
                f"entry {seq} is stored in no record's canonical form: its bytes were "
                f"changed after it was written"))
        else:
            raise VerificationFailed(number, "neither a record nor a leaf entry")
        self.entries += 1
        self.first_seq = seq if self.first_seq is None else self.first_seq

    def segment(self, number: int, obj: Mapping[str, Any]) -> None:
        segment = obj["segment"]
        if not isinstance(segment, dict) or set(segment) != {"first", "last", "hash"}:
            raise VerificationFailed(number, "a segment line without its fields")
        if self.size is None or not self.leaves or (segment["first"], segment["last"]) != (
                self.size + 1, self.size + len(self.leaves)):
            raise VerificationFailed(number, (
                "a segment line that does not close the entries before it: an entry was "
                "dropped, inserted or moved"))
        self.head = segment_hash(self.head, self.leaves)
        if segment["hash"] != self.head.hex():
            raise VerificationFailed(number, (
                f"the entries {segment['first']}..{segment['last']} do not hash to their "
                f"segment's stored hash: one of them was changed after it was written"))
        self.size, self.leaves, self.open = segment["last"], [], True
        if self.kept.get(self.size, self.head) != self.head:
            raise VerificationFailed(number, f"the log at {self.size} differs from the "
                                             f"checkpoint kept at that size: the log was "
                                             f"rewritten")


def verify(lines: Iterable[bytes], keys: Iterable[PublicKey],
           kept: Mapping[int, bytes] | None = None) -> Verified:
    """Check an export line by line (see the module docstring); VerificationFailed names
    the first line that fails."""
    state = _Chain({k.key_id: k for k in keys}, kept or {})
    digest = hashlib.sha256()
    export = ExportLines(lines)
    for number, line, obj in export:
        digest.update(line + b"\n")
        if "checkpoint" in obj:
            state.checkpoint(number, obj)
        elif "segment" in obj:
            state.segment(number, obj)
        else:
            state.entry(number, obj)
    manifest = export.last_manifest()
    number = export.number
    if state.leaves or state.open:
        raise VerificationFailed(number, "entries after the last checkpoint: no signature "
                                         "covers them")
    if manifest.get("format") != EXPORT_FORMAT:
        raise VerificationFailed(number, f"the manifest's format is not {EXPORT_FORMAT}")
    counted = (state.records, state.entries)
    if (manifest.get("records"), manifest.get("entries")) != counted:
        raise VerificationFailed(number, (
            f"the manifest counts {manifest.get('records')} records in "
            f"{manifest.get('entries')} entries, the export holds {counted[0]} in "
            f"{counted[1]}"))
    if manifest.get("digest") != digest.hexdigest():
        raise VerificationFailed(number, "the manifest's digest is not that of the lines "
                                         "before it: the export was cut or re-mixed")
    run_id = manifest.get("run_id")
    if run_id is not None and state.runs - {run_id}:
        raise VerificationFailed(number, f"records of another run in run {run_id}'s export")
    check_signed(number, "the manifest", manifest, export.signature, state.by_id)
    return Verified(run_id=run_id if isinstance(run_id, int) else None,
                    records=state.records, entries=state.entries,
                    checkpoints=state.checkpoints, first_seq=state.first_seq,
                    last_seq=state.size if state.entries else None,
                    key_id=str(manifest["key_id"]), next_after=manifest.get("next_after"))
