"""Deletion evidence: the signing keys, the lookup of an object's deletions, and the
verification of run exports made before the evidence log (format sweeper-evidence/1).

Exports are now slices of the evidence log (service/evidence/chain.py writes it,
service/evidence/export_slices.py exports and verifies it). A sweeper-evidence/1 export, as
`GET /v1/runs/{id}/evidence` answered before revision 0019, is JSON lines: each record line
carries the run's id and `prev`, the SHA-256 of the previous line's bytes (the first line's
`prev` is the run's genesis digest), and the last line is a manifest (format, run, record
count, last digest, export time, key id) with an Ed25519 signature over its canonical JSON.
`verify` still checks such files; the chain there was computed at export, so it proves only
that the file is what the server signed then.

Keys: the private key from a PEM file (`openssl genpkey -algorithm ed25519`) or base64 of
its 32 raw bytes, from SWEEPER_EVIDENCE_SIGNING_KEY_FILE or SWEEPER_EVIDENCE_SIGNING_KEY;
never logged or rendered. A key's id is the first 16 hex digits of the SHA-256 of its raw
public key. Earlier public keys stay published (SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS) so
exports and checkpoints signed before a rotation still verify. With the embedded database
(local use) and no key configured, a key is created once under SWEEPER_DATA_DIR;
otherwise, with no key, checkpoints and manifests are unsigned and verification says so.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.statements import Statement, fetch

log = logging.getLogger(__name__)

FORMAT: Final = "sweeper-evidence/1"
KEY_ID_HEX: Final = 16
LOCAL_KEY_FILE: Final = "evidence-signing-key.pem"


class KeyProblem(ValueError):
    """A key that cannot be read; the message never quotes the key."""


def digest(line: bytes) -> str:
    """SHA-256 of one line's bytes (without its line break), hex."""
    return hashlib.sha256(line).hexdigest()


def genesis(run_id: int) -> str:
    """The `prev` of a run's first record line."""
    return digest(f"{FORMAT} run {run_id}".encode())


def signed_bytes(statement: Mapping[str, Any]) -> bytes:
    """The bytes a manifest's (or a checkpoint's) signature is over: its canonical JSON."""
    return json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """The id a manifest names its key by."""
    return hashlib.sha256(_raw_public(key)).hexdigest()[:KEY_ID_HEX]


@dataclass(frozen=True)
class PublicKey:
    """A published verification key."""

    key: Ed25519PublicKey = field(repr=False)

    @property
    def key_id(self) -> str:
        return key_id(self.key)

    @property
    def base64(self) -> str:
        return base64.b64encode(_raw_public(self.key)).decode()

    @property
    def pem(self) -> str:
        return self.key.public_bytes(serialization.Encoding.PEM,
                                     serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@dataclass(frozen=True)
class Signer:
    """The current signing key and the public keys published beside it (current first)."""

    private: Ed25519PrivateKey = field(repr=False)
    previous: tuple[PublicKey, ...] = ()

    @property
    def current(self) -> PublicKey:
        return PublicKey(self.private.public_key())

    @property
    def published(self) -> list[PublicKey]:
        current = self.current
        return [current, *(k for k in self.previous if k.key_id != current.key_id)]

    def sign(self, payload: bytes) -> str:
        return base64.b64encode(self.private.sign(payload)).decode()


def b64decode(text: str) -> bytes | None:
    """Bytes from base64 (standard or URL-safe, padding optional), None if it is not."""
    try:
        return base64.b64decode(text.strip() + "=" * (-len(text.strip()) % 4),
                                altchars=b"-_" if ("-" in text or "_" in text) else None,
                                validate=True)
    except (binascii.Error, ValueError):
        return None


def private_key(text: bytes) -> Ed25519PrivateKey:
    """An Ed25519 private key from PEM (PKCS#8, unencrypted) or base64 of 32 raw bytes."""
    if b"-----BEGIN" in text:
        try:
            key = serialization.load_pem_private_key(text, password=None)
        except (ValueError, TypeError):
            raise KeyProblem("not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyProblem("not an Ed25519 key")
        return key
    raw = b64decode(text.decode("ascii", "replace"))
    if raw is None or len(raw) != 32:
        raise KeyProblem("neither PEM nor base64 of 32 bytes")
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_keys(text: bytes) -> list[PublicKey]:
    """Verification keys from a PEM public key (or several), base64 of 32 raw bytes (one
    per line or comma-separated), or the JSON `GET /v1/evidence/public-key` answers."""
    stripped = text.strip()
    if stripped.startswith(b"{"):
        try:
            doc = json.loads(stripped)
            texts = [k["public_key"] for k in doc["keys"]]
        except (ValueError, KeyError, TypeError):
            raise KeyProblem("JSON without keys[].public_key") from None
        return [_public_fromb64decode(t) for t in texts]
    if b"-----BEGIN" in stripped:
        keys = []
        for block in stripped.split(b"-----END PUBLIC KEY-----"):
            if block.strip():
                try:
                    key = serialization.load_pem_public_key(block + b"-----END PUBLIC KEY-----")
                except ValueError:
                    raise KeyProblem("not a PEM public key") from None
                if not isinstance(key, Ed25519PublicKey):
                    raise KeyProblem("not an Ed25519 key")
                keys.append(PublicKey(key))
        return keys
    parts = [p for p in stripped.decode("ascii", "replace").replace(",", "\n").split() if p]
    if not parts:
        raise KeyProblem("no key")
    return [_public_fromb64decode(p) for p in parts]


def _public_fromb64decode(text: object) -> PublicKey:
    raw = b64decode(text) if isinstance(text, str) else None
    if raw is None or len(raw) != 32:
        raise KeyProblem("a public key is neither PEM nor base64 of 32 bytes")
    return PublicKey(Ed25519PublicKey.from_public_bytes(raw))


def new_key() -> str:
    """A fresh signing key as base64 of its 32 raw bytes (`sweeper local`: one per run)."""
    return base64.b64encode(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
        serialization.NoEncryption())).decode()


def local_key(data_dir: Path) -> Ed25519PrivateKey:
    """The local (embedded-database) signing key under `data_dir`, created on first use
    (readable by its owner only)."""
    path = data_dir / LOCAL_KEY_FILE
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption())
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: use theirs
            pass
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
    return private_key(path.read_bytes())


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
    run_id: int | None = None
    last: str | None = None
    records = 0
    export = ExportLines(lines)
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
    manifest = export.last_manifest()
    where = export.number
    if run_id is None:  # an export with no records
        if not isinstance(manifest.get("run_id"), int):
            raise VerificationFailed(where, "a manifest without its run_id")
        run_id, last = manifest["run_id"], genesis(manifest["run_id"])
    if manifest.get("format") != FORMAT:
        raise VerificationFailed(where, f"the manifest's format is not {FORMAT}")
    if manifest.get("run_id") != run_id:
        raise VerificationFailed(where, "the manifest names another run")
    if manifest.get("records") != records:
        raise VerificationFailed(where, f"the manifest counts {manifest.get('records')} records, "
                                        f"the export holds {records}")
    if manifest.get("last") != last:
        raise VerificationFailed(where, "the manifest's last digest is not the last record's: "
                                        "records were changed or dropped at the end")
    check_signed(where, "the manifest", manifest, export.signature, by_id)
    return Verified(run_id=run_id, records=records, key_id=str(manifest["key_id"]))


# -- reading it from the ledger -----------------------------------------------------------------

_RECORD_COLUMNS: Final = ("item_id, tenant_id, object_id, policy, policy_version, "
                          "operation_key, outcome, upstream_status, attempts, completed_at")

# An object's deletions: its succeeded items (any policy and version) and the evidence kept
# of pruned ones, oldest first; both through an index led by (tenant_id, object_id).
_LOOKUP = Statement("signing.lookup", (
    "Whether an object was deleted, when and under which policy: its succeeded items and the "
    "evidence kept of pruned ones."), f"""
    SELECT 'ledger' AS kept_in, b.run_id, i.id AS item_id, i.tenant_id, i.object_id, i.policy,
           i.policy_version, i.operation_key, i.last_outcome AS outcome,
           i.last_status_code AS upstream_status, i.attempts, i.completed_at
    FROM items i LEFT JOIN batches b ON b.id = i.batch_id
    WHERE i.tenant_id = :tenant AND i.object_id = :object AND i.status = 'succeeded'
    UNION ALL
    SELECT 'evidence', run_id, {_RECORD_COLUMNS} FROM evidence
    WHERE tenant_id = :tenant AND object_id = :object
    ORDER BY completed_at, item_id
    LIMIT :limit
""")  # noqa: S608 - only a constant is interpolated


async def lookup(engine: AsyncEngine, tenant_id: str, object_id: str, *, limit: int
                 ) -> list[dict[str, Any]]:
    """An object's deletions, oldest first: from the ledger and from kept evidence."""
    rows = await fetch(engine, _LOOKUP, {"tenant": tenant_id, "object": object_id,
                                         "limit": limit})
    return [dict(r._mapping) for r in rows]
