"""Deletion evidence nobody can quietly edit: a run's export as a hash chain closed by a
signed manifest, and its offline verification.

The export (`GET /v1/runs/{id}/evidence`) is JSON lines. Each record line carries the run's
id and `prev`, the SHA-256 of the previous line's bytes (the first line's `prev` is the
run's genesis digest, so lines of another run's export do not fit). The last line is the
manifest: the format, the run, the number of records, the digest of the last record line,
when it was exported and the id of the signing key, with an Ed25519 signature over its
canonical JSON. A changed, dropped, inserted or reordered line breaks the chain at the first
line that no longer follows its predecessor; a dropped tail or a changed count breaks the
manifest; a manifest changed or signed by an unpublished key fails its signature.

Keys: the private key from a PEM file (`openssl genpkey -algorithm ed25519`) or base64 of
its 32 raw bytes, from SWEEPER_EVIDENCE_SIGNING_KEY_FILE or SWEEPER_EVIDENCE_SIGNING_KEY;
never logged or rendered. A key's id is the first 16 hex digits of the SHA-256 of its raw
public key. Earlier public keys stay published (SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS) so
exports signed before a rotation still verify. With the embedded database (local use) and
no key configured, a key is created once under SWEEPER_DATA_DIR; otherwise, with no key,
manifests are unsigned and verification says so.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
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


def _canonical(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _iso(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


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


def _b64(text: str) -> bytes | None:
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
    raw = _b64(text.decode("ascii", "replace"))
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
        return [_public_from_b64(t) for t in texts]
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
    return [_public_from_b64(p) for p in parts]


def _public_from_b64(text: object) -> PublicKey:
    raw = _b64(text) if isinstance(text, str) else None
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


class Chain:
    """Writes one run's export: record lines, then the manifest."""

    def __init__(self, run_id: int, signer: Signer | None) -> None:
        self.run_id = run_id
        self.signer = signer
        self.records = 0
        self.last = genesis(run_id)

    def line(self, record: Mapping[str, Any]) -> bytes:
        """A record's line (without its line break), chained to the one before."""
        body = json.dumps({**record, "run_id": self.run_id, "prev": self.last},
                          default=_iso, separators=(",", ":")).encode()
        self.last = digest(body)
        self.records += 1
        return body

    def manifest(self, exported_at: datetime | None = None) -> bytes:
        """The closing line: what the chain holds, signed when a key is configured."""
        manifest = {"format": FORMAT, "run_id": self.run_id, "records": self.records,
                    "last": self.last,
                    "exported_at": (exported_at or datetime.now(UTC)).isoformat(),
                    "key_id": self.signer.current.key_id if self.signer else None}
        signature = self.signer.sign(_canonical(manifest)) if self.signer else None
        return json.dumps({"manifest": manifest, "signature": signature},
                          separators=(",", ":")).encode()


class VerificationFailed(Exception):
    """The export is not what was signed; `line` is the first line that fails (1-based)."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line
        self.reason = reason


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
    records = number = 0
    manifest: dict[str, Any] | None = None
    signature: object = None
    for number, raw in enumerate(lines, 1):
        line = raw[:-1] if raw.endswith(b"\n") else raw
        if manifest is not None:
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
            manifest, signature = obj["manifest"], obj.get("signature")
            continue
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
    if manifest is None:
        raise VerificationFailed(number + 1, "missing: the export ends without its manifest")
    where = number
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
    named = manifest.get("key_id")
    if named is None or signature is None:
        raise VerificationFailed(where, "the manifest is not signed (the server had no "
                                        "signing key)")
    key = by_id.get(str(named))
    if key is None:
        raise VerificationFailed(where, f"signed with key {named}, which is not among the "
                                        f"public keys given ({', '.join(sorted(by_id)) or 'none'})")
    sig = _b64(signature) if isinstance(signature, str) else None
    try:
        if sig is None:
            raise InvalidSignature
        key.key.verify(sig, _canonical(manifest))
    except InvalidSignature:
        raise VerificationFailed(where, f"the manifest's signature does not verify under key "
                                        f"{named}: the manifest was changed or signed by "
                                        f"another key") from None
    return Verified(run_id=run_id, records=records, key_id=str(named))


# -- reading it from the ledger -----------------------------------------------------------------

# Records per evidence page: each page is one short read whose connection goes back to the
# pool before the page is written to the client, so a slow reader holds no connection and
# no transaction, and the stream's memory is one page.
PAGE_ROWS: Final = 1000

_RECORD_COLUMNS: Final = ("item_id, tenant_id, object_id, policy, policy_version, "
                          "operation_key, outcome, upstream_status, attempts, completed_at")

# One page of a run's deletion evidence: its succeeded items still in the ledger and the
# evidence retention kept of those it pruned, after `after` in item id order (keyset: the
# next page starts past the last id sent, so no record is sent twice; retention moves an
# item's evidence in one statement, so a page finds it in exactly one of the two).
_PAGE = Statement("evidence.page", (
    "One page of a run's deletion evidence, from its succeeded items and the evidence kept "
    "of pruned ones, after a keyset cursor, by item id."), f"""
    (SELECT i.id AS item_id, i.tenant_id, i.object_id, i.policy, i.policy_version,
            i.operation_key, i.last_outcome AS outcome, i.last_status_code AS upstream_status,
            i.attempts, i.completed_at
     FROM items i JOIN batches b ON b.id = i.batch_id
     WHERE b.run_id = :id AND i.status = 'succeeded' AND i.id > :after
     ORDER BY i.id LIMIT :page)
    UNION ALL
    (SELECT {_RECORD_COLUMNS} FROM evidence
     WHERE run_id = :id AND item_id > :after
     ORDER BY item_id LIMIT :page)
    ORDER BY item_id
    LIMIT :page
""")  # noqa: S608 - only a constant is interpolated

# An object's deletions: its succeeded items (any policy and version) and the evidence kept
# of pruned ones, oldest first; both through an index led by (tenant_id, object_id).
_LOOKUP = Statement("evidence.lookup", (
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


async def pages(engine: AsyncEngine, run_id: int, *, page_rows: int = PAGE_ROWS
                ) -> AsyncIterator[list[dict[str, Any]]]:
    """Yield the run's deletion evidence, one record per succeeded item in id order, in
    pages of at most `page_rows` (never an empty one). Each page is read at its own moment
    in its own short transaction: an item that succeeds while the stream runs is included
    when its id is past the pages already read."""
    after = sent = 0
    while True:
        try:
            rows = await fetch(engine, _PAGE, {"id": run_id, "after": after, "page": page_rows})
        except Exception as exc:
            if sent:  # the caller has passed part of the evidence on: say where it broke
                log.warning("evidence read failed part way", extra={
                    "run_id": run_id, "records_sent": sent, "error_type": type(exc).__name__})
            raise
        # the connection is back in the pool before the caller sees the page
        if not rows:
            return
        page = [dict(row._mapping) for row in rows]
        after, sent = page[-1]["item_id"], sent + len(page)
        yield page
        if len(page) < page_rows:
            return


async def lookup(engine: AsyncEngine, tenant_id: str, object_id: str, *, limit: int
                 ) -> list[dict[str, Any]]:
    """An object's deletions, oldest first: from the ledger and from kept evidence."""
    rows = await fetch(engine, _LOOKUP, {"tenant": tenant_id, "object": object_id,
                                         "limit": limit})
    return [dict(r._mapping) for r in rows]
