"""The worker's read side of stored credentials: `CredentialStore.get`, on the hot path.

A call needs its tenant's credential; thousands of calls a second must not mean thousands
of reads. Each replica keeps what it read (decrypted, in memory only) for `ttl_s`, and an
absent or unreadable credential for the shorter `negative_ttl_s`, so a PUT on one replica
reaches every replica within `ttl_s` (a DELETE too) and a first PUT within
`negative_ttl_s`. Concurrent misses of one row share one read. The cache is bounded
(least recently used out first). `invalidate` drops a row at once, for this replica's own
writes.

A row no configured key opens (its key dropped from the settings, or the row altered or
copied from another row) is no credential: logged with its tenant, upstream and key id,
and answered None like an absent one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.credentials import tenant_credentials
from service.credentials.crypto import CredentialUnreadable, Keyring

log = logging.getLogger(__name__)

TTL_S: Final = 5.0
NEGATIVE_TTL_S: Final = 1.0
MAX_ENTRIES: Final = 10_000

_Row = tuple[str, str]  # (tenant_id, upstream)


@dataclass
class _Entry:
    value: str | None = field(repr=False)
    expires_at: float  # on the store's monotonic clock


class CredentialStore:
    """Credentials stored through the API, cached briefly per replica."""

    def __init__(self, engine: AsyncEngine, keyring: Keyring, *, ttl_s: float = TTL_S,
                 negative_ttl_s: float = NEGATIVE_TTL_S, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (0 < negative_ttl_s <= ttl_s and max_entries >= 1):
            raise ValueError("need 0 < negative_ttl_s <= ttl_s and max_entries >= 1")
        self._engine = engine
        self._keyring = keyring
        self._ttl_s = ttl_s
        self._negative_ttl_s = negative_ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._cache: OrderedDict[_Row, _Entry] = OrderedDict()
        self._loading: dict[_Row, asyncio.Task[str | None]] = {}

    def __repr__(self) -> str:
        return f"CredentialStore(cached={len(self._cache)}, ttl_s={self._ttl_s})"

    async def get(self, tenant_id: str, upstream: str) -> str | None:
        """The tenant's credential for `upstream`, or None. A database error propagates
        (nothing is cached)."""
        row = (tenant_id, upstream)
        entry = self._cache.get(row)
        if entry is not None and entry.expires_at > self._clock():
            self._cache.move_to_end(row)
            return entry.value
        task = self._loading.get(row)
        if task is None:
            task = asyncio.create_task(self._load(row), name="credential-read")
            self._loading[row] = task
            task.add_done_callback(lambda done: self._settle(row, done))
        # shielded: a caller cancelled mid-wait does not cancel the read others share
        return await asyncio.shield(task)

    def invalidate(self, tenant_id: str, upstream: str) -> None:
        """Forget the row now (this replica wrote it); a read in progress is not kept."""
        row = (tenant_id, upstream)
        self._cache.pop(row, None)
        self._loading.pop(row, None)

    async def _load(self, row: _Row) -> str | None:
        tenant_id, upstream = row
        sealed = await tenant_credentials.read(self._engine, tenant_id, upstream)
        if sealed is None:
            return None
        try:
            return self._keyring.open(sealed, tenant_id, upstream)
        except CredentialUnreadable as exc:
            log.warning("credential unreadable: treated as none", extra={
                "tenant_id": tenant_id, "upstream": upstream, "key_id": exc.key_id,
                "reason": exc.reason})
            return None

    def _settle(self, row: _Row, task: asyncio.Task[str | None]) -> None:
        """Cache a finished read, unless `invalidate` superseded it."""
        current = self._loading.get(row) is task
        if current:
            del self._loading[row]
        # exception() also marks a failed read as seen (its callers got the error)
        if task.cancelled() or task.exception() is not None or not current:
            return
        value = task.result()
        ttl = self._ttl_s if value is not None else self._negative_ttl_s
        self._cache[row] = _Entry(value, self._clock() + ttl)
        self._cache.move_to_end(row)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
