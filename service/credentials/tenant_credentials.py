"""The `tenant_credentials` rows: write, delete, list, read one, and re-encrypt under the
current key. Only sealed values pass through here (service/credentials/crypto.py); a
secret never reaches SQL, so no statement, parameter or database log can hold one.

Every operator change is one transaction with its audit row, which names the row and its
fingerprints, never the secret. Times are the database's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.credentials.crypto import CredentialUnreadable, Keyring, Sealed
from service.db.statements import Database, Statement, fetch, run
from service.evidence import audit_trail

log = logging.getLogger(__name__)

REENCRYPT_PAGE_ROWS: Final = 500

# `before` reads the row it replaces, locked, for the audit row's previous fingerprint. The
# INSERT reads it (the join) so that it is read before the row changes: a CTE is evaluated
# when first used, and one used only in RETURNING would find the row already updated.
_PUT = Statement("tenant_credentials.put", (
    "Store a tenant's sealed credential for an upstream, replacing any earlier one; returns "
    "the row's public part and the fingerprint it replaced."), """
    WITH before AS (
        SELECT fingerprint FROM tenant_credentials
        WHERE tenant_id = :tenant_id AND upstream = :upstream FOR UPDATE
    )
    INSERT INTO tenant_credentials AS c
        (tenant_id, upstream, key_id, nonce, ciphertext, fingerprint, updated_by)
    SELECT CAST(:tenant_id AS text), CAST(:upstream AS text), CAST(:key_id AS text),
           CAST(:nonce AS bytea), CAST(:ciphertext AS bytea), CAST(:fingerprint AS text),
           CAST(:actor AS text)
    FROM (VALUES (1)) AS one (n) LEFT JOIN before ON true
    ON CONFLICT (tenant_id, upstream) DO UPDATE
    SET key_id = excluded.key_id, nonce = excluded.nonce, ciphertext = excluded.ciphertext,
        fingerprint = excluded.fingerprint, updated_at = now(), updated_by = excluded.updated_by
    RETURNING c.tenant_id, c.upstream, c.fingerprint, c.updated_at, c.updated_by,
              (SELECT fingerprint FROM before) AS previous_fingerprint
""")

_DELETE = Statement("tenant_credentials.delete", (
    "Remove a tenant's credential for an upstream; returns its fingerprint."), """
    DELETE FROM tenant_credentials WHERE tenant_id = :tenant_id AND upstream = :upstream
    RETURNING fingerprint
""")

_LIST = Statement("tenant_credentials.list", (
    "A tenant's stored credentials by upstream: public parts only."), """
    SELECT upstream, fingerprint, updated_at, updated_by FROM tenant_credentials
    WHERE tenant_id = :tenant_id ORDER BY upstream
""")

_READ = Statement("tenant_credentials.read", (
    "One sealed credential, for a worker's call (by primary key)."), """
    SELECT key_id, nonce, ciphertext FROM tenant_credentials
    WHERE tenant_id = :tenant_id AND upstream = :upstream
""")

# Keyset pages on the primary key: rows that cannot be opened are passed over, not read
# again, and rows written meanwhile under the current key are not in the page at all.
_NOT_CURRENT = Statement("tenant_credentials.not_current", (
    "The next page of rows sealed under a key other than the current one."), """
    SELECT tenant_id, upstream, key_id, nonce, ciphertext FROM tenant_credentials
    WHERE key_id <> :current
      AND (CAST(:after_tenant AS text) IS NULL
           OR (tenant_id, upstream) > (CAST(:after_tenant AS text), CAST(:after_upstream AS text)))
    ORDER BY tenant_id, upstream
    LIMIT :limit
""")

# A row whose nonce changed since it was read was written meanwhile (every write draws a
# new nonce): that write is newer and already under the current key, so it stays.
_RESEAL = Statement("tenant_credentials.reseal", (
    "Replace a page of rows' sealed values by the same secrets under the current key, "
    "unless a write replaced a row since it was read."), """
    UPDATE tenant_credentials c
    SET key_id = :key_id, nonce = n.nonce, ciphertext = n.ciphertext,
        fingerprint = n.fingerprint
    FROM unnest(CAST(:tenant_ids AS text[]), CAST(:upstreams AS text[]),
                CAST(:old_nonces AS bytea[]), CAST(:nonces AS bytea[]),
                CAST(:ciphertexts AS bytea[]), CAST(:fingerprints AS text[]))
         AS n(tenant_id, upstream, old_nonce, nonce, ciphertext, fingerprint)
    WHERE c.tenant_id = n.tenant_id AND c.upstream = n.upstream AND c.nonce = n.old_nonce
    RETURNING c.tenant_id
""")


@dataclass(frozen=True)
class StoredCredential:
    """The public part of a stored credential: never the secret."""

    tenant_id: str
    upstream: str
    fingerprint: str
    updated_at: datetime
    updated_by: str


async def put(engine: AsyncEngine, keyring: Keyring, tenant_id: str, upstream: str,
              secret: str, *, actor: str, reason: str | None = None) -> StoredCredential:
    """Seal `secret` for this row under the current key and store it (a rotation is a new
    put), with its audit row."""
    sealed = keyring.seal(secret, tenant_id, upstream)
    fingerprint = keyring.fingerprint(secret)
    async with engine.begin() as conn:
        row = (await run(conn, _PUT, {
            "tenant_id": tenant_id, "upstream": upstream, "key_id": sealed.key_id,
            "nonce": sealed.nonce, "ciphertext": sealed.ciphertext,
            "fingerprint": fingerprint, "actor": actor})).one()
        await audit_trail.record(conn, actor=actor, action="credential.put", reason=reason,
                                 details={
            "tenant_id": tenant_id, "upstream": upstream, "fingerprint": fingerprint,
            "previous_fingerprint": row.previous_fingerprint, "key_id": sealed.key_id})
    return StoredCredential(row.tenant_id, row.upstream, row.fingerprint, row.updated_at,
                            row.updated_by)


async def delete(engine: AsyncEngine, tenant_id: str, upstream: str, *, actor: str,
                 reason: str | None = None) -> bool:
    """Remove the row, with its audit row; False if there was none."""
    async with engine.begin() as conn:
        row = (await run(conn, _DELETE, {"tenant_id": tenant_id, "upstream": upstream})
               ).first()
        if row is None:
            return False
        await audit_trail.record(conn, actor=actor, action="credential.delete", reason=reason,
                                 details={"tenant_id": tenant_id, "upstream": upstream,
                                          "fingerprint": row.fingerprint})
    return True


async def list_for_tenant(engine: AsyncEngine, tenant_id: str) -> list[StoredCredential]:
    """The tenant's stored credentials by upstream (public parts)."""
    rows = await fetch(engine, _LIST, {"tenant_id": tenant_id})
    return [StoredCredential(tenant_id, r.upstream, r.fingerprint, r.updated_at, r.updated_by)
            for r in rows]


async def read(db: Database, tenant_id: str, upstream: str) -> Sealed | None:
    """The sealed credential of one row, or None."""
    rows = await fetch(db, _READ, {"tenant_id": tenant_id, "upstream": upstream})
    return Sealed(rows[0].key_id, rows[0].nonce, rows[0].ciphertext) if rows else None


@dataclass(frozen=True)
class Reencryption:
    """What a re-encryption pass did: rows moved to the current key, rows a newer write
    replaced meanwhile (already current), and rows no configured key opens (left as they
    are: (tenant_id, upstream, key_id) each)."""

    reencrypted: int
    replaced_meanwhile: int
    unreadable: Sequence[tuple[str, str, str]]


async def reencrypt(engine: AsyncEngine, keyring: Keyring, *, actor: str,
                    page_rows: int = REENCRYPT_PAGE_ROWS) -> Reencryption:
    """Move every row to the current key (and its fingerprint), a page per transaction,
    with one audit row for the pass. Rows that do not open are reported and left alone;
    once none is under a previous key, that key may be dropped from the settings."""
    moved = raced = 0
    unreadable: list[tuple[str, str, str]] = []
    after: tuple[str | None, str | None] = (None, None)
    while True:
        rows = await fetch(engine, _NOT_CURRENT, {
            "current": keyring.current_id, "after_tenant": after[0], "after_upstream": after[1],
            "limit": page_rows})
        if not rows:
            break
        after = (rows[-1].tenant_id, rows[-1].upstream)
        page: dict[str, list[Any]] = {k: [] for k in (
            "tenant_ids", "upstreams", "old_nonces", "nonces", "ciphertexts", "fingerprints")}
        for r in rows:
            try:
                secret = keyring.open(Sealed(r.key_id, r.nonce, r.ciphertext),
                                      r.tenant_id, r.upstream)
            except CredentialUnreadable as exc:
                log.warning("credential unreadable", extra={
                    "tenant_id": r.tenant_id, "upstream": r.upstream, "key_id": r.key_id,
                    "reason": exc.reason})
                unreadable.append((r.tenant_id, r.upstream, r.key_id))
                continue
            sealed = keyring.seal(secret, r.tenant_id, r.upstream)
            for name, value in (("tenant_ids", r.tenant_id), ("upstreams", r.upstream),
                                ("old_nonces", r.nonce), ("nonces", sealed.nonce),
                                ("ciphertexts", sealed.ciphertext),
                                ("fingerprints", keyring.fingerprint(secret))):
                page[name].append(value)
        if page["tenant_ids"]:
            done = await fetch(engine, _RESEAL, {"key_id": keyring.current_id, **page})
            moved += len(done)
            raced += len(page["tenant_ids"]) - len(done)
    result = Reencryption(moved, raced, unreadable)
    async with engine.begin() as conn:
        await audit_trail.record(conn, actor=actor, action="credential.reencrypt", reason=None,
                                 details={"key_id": keyring.current_id, "reencrypted": moved,
                                          "replaced_meanwhile": raced,
                                          "unreadable": len(unreadable)})
    return result
