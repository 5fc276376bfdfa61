"""A store target: the policy's deletion statement run on the store's own database.

One call is one transaction on the store, for up to `batch.max_objects` items of one scope:

  1. the guard, if the policy has one, is read (shared by the process, at most once per
     `every_seconds`); over its threshold nothing runs and the scope closes like a 429;
  2. `lock_timeout` and `statement_timeout` are set for the transaction;
  3. the batch's identity (policy, version, the run's cutoff, the sorted object ids) is
     inserted into the store's ledger table. A conflict means this batch already ran and
     committed: its recorded result is the answer, nothing is deleted again;
  4. the statement runs with `:object_ids` and `:cutoff`: it re-checks the age predicate,
     so a row that became active again after discovery is left alone (its item ends
     `skipped`), and returns the object id of each row it deleted;
  5. what it deleted is written to the identity's row, and the transaction commits.

One bad row fails alone. A statement that fails on something one row can cause (a value its
type cannot take, SQLSTATE class 22, such as `1); DROP TABLE carts;--` against a bigint[]
cast; a constraint one row breaks, class 23; a lock one row's holder keeps past
`lock_timeout`, 55P03) is rolled back and the batch run again, split: each half under a
savepoint, a failing half split again, down to single rows. The other rows finish on their
own merits; a single row that still fails gets its own outcome (`store_refused:<SQLSTATE>`,
permanent, for a value; `store_busy:<SQLSTATE>`, transient, for a lock). A batch with no
bad row runs as before: one statement, no savepoint. The split stops starting statements
when the lease could end before one finished: what is left is `store_busy:unsplit`
(transient, retried). Any other failure (a missing table, a statement timeout, a lost
connection) is the whole batch's, as before.

A redelivered item (its lease expired after the store committed, before the ledger did)
may come back in a batch of other items: its identity is new, so before the statement runs
the objects earlier batches of the same policy version recorded as deleted are looked up
(only for batches holding a retried item: a scan of the ledger table, which holds a row per
batch and no index but its key and its age, so the common batch writes no more than that
row) and count as deleted. Retention prunes the table by age like Sweeper's own history.

The cutoff is that of the run whose batch released the item (for an item a webhook
released, the moment it was released), read from the ledger.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from service.config.policies import Policies, Policy, Store
from service.db.engine import sqlstate
from service.db.statements import Statement, fetch, run
from service.ledger.claims import Lease
from service.outcomes import Answer, Classified, Failure, Outcome
from service.protocols.transport import SendGate
from service.sweeps.store_databases import (
    STORE_ERRORS,
    StoreError,
    Stores,
    describe,
    failure_of,
    limit_transaction,
    target_statement,
)
from service.upstreams.deletion_api import CallResult

DELETED: Final = Classified(Outcome.SUCCEEDED, "store_deleted")
# left when the lease would end before another statement of a split could (retried)
UNSPLIT: Final = Classified(Outcome.TRANSIENT, f"{Failure.STORE_BUSY.value}:unsplit")
# SQLSTATEs one row can cause: a value its type cannot take (class 22), a constraint it
# breaks (class 23), a lock its holder keeps past lock_timeout
_ONE_ROW_CLASSES: Final = ("22", "23")
_ONE_ROW_CODES: Final = frozenset({"55P03"})
# of the lease, the share a split may use (the rest covers the claim and the completion)
_SPLIT_LEASE_SHARE: Final = 0.8


def one_row_failure(exc: BaseException) -> str | None:
    """The SQLSTATE of a statement's failure that one row can cause, or None."""
    code = sqlstate(exc)
    if code is not None and (code.startswith(_ONE_ROW_CLASSES) or code in _ONE_ROW_CODES):
        return code
    return None
# a concurrent CREATE TABLE of the same name: duplicate table, its row type's unique key,
# or its row type found existing (42710, "type ... already exists": which one a loser gets
# depends on when the winner commits)
_CREATED_MEANWHILE: Final = frozenset({"42P07", "23505", "42710"})

_BATCH_CUTOFFS = Statement("store_targets.batch_cutoffs", (
    "The cutoff of the runs that released these batches: what a store target's statement "
    "re-checks."), """
    SELECT b.id, r.cutoff FROM batches b JOIN runs r ON r.id = b.run_id
    WHERE b.id = ANY(CAST(:ids AS bigint[]))
""")
_RELEASED_AT = Statement("store_targets.released_at", (
    "When a webhook released these items (no batch): their cutoff."),
    "SELECT id, coalesce(released_at, now()) AS cutoff FROM items "
    "WHERE id = ANY(CAST(:ids AS bigint[]))")
# batches whose cutoff is known, most recent last (a drain reads few batches at a time)
_CUTOFF_CACHE = 4096


def ledger_create(table: str) -> Statement:
    """The store's ledger table of batches deleted (docs/stores.md shows it for a DBA
    who creates it rather than granting CREATE)."""
    return Statement("store_targets.ledger_create", "Create the store's ledger of deleted "
                     "batches.", f"""
    CREATE TABLE {table} (
        identity       text PRIMARY KEY,
        policy         text NOT NULL,
        policy_version integer NOT NULL,
        cutoff         timestamptz NOT NULL,
        objects        integer NOT NULL,
        deleted        text[] NOT NULL DEFAULT '{{}}',
        deleted_at     timestamptz NOT NULL DEFAULT now()
    )""")


def ledger_index(table: str) -> Statement:
    """Retention prunes the ledger by age (service/cluster/retention.py); without this index each of
    its batches would read the whole table."""
    index = f"{table.rpartition('.')[2][:52]}_deleted_at"  # in the table's schema, <= 63
    return Statement("store_targets.ledger_index", "Index the store's ledger by when each batch "
                     "ran, for pruning.",
                     f"CREATE INDEX IF NOT EXISTS {index} ON {table} (deleted_at)")


def ledger_prune(table: str) -> Statement:
    return Statement("store_targets.ledger_prune", (
        "Delete one batch of the store's ledger rows older than the retention period, "
        "oldest first, skipping rows another replica holds."), f"""
    WITH doomed AS (
        SELECT identity FROM {table}
        WHERE deleted_at < now() - make_interval(secs => :keep_s)
        ORDER BY deleted_at
        LIMIT :batch
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM {table} t USING doomed WHERE t.identity = doomed.identity""")  # noqa: S608


# what a target asks before its first batch (is the table there) and retention before each
# pass (and is it indexed for pruning)
LEDGER_FOUND = Statement("store_targets.ledger_found", (
    "Whether a store's ledger table exists, and whether an index led by deleted_at serves "
    "its pruning."), """
    SELECT to_regclass(:t) IS NOT NULL AS present,
           EXISTS (SELECT 1 FROM pg_index i
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                   WHERE i.indrelid = to_regclass(:t) AND a.attname = 'deleted_at') AS indexed
""")


def ledger_tables(policies: Policies) -> dict[str, str]:
    """Each store a policy's target deletes from, and its ledger table."""
    return {p.config.target.store: policies.stores[p.config.target.store].config.ledger_table
            for p in policies.policies.values() if p.config.target is not None}


def ledger_insert(table: str) -> Statement:
    return Statement("store_targets.ledger_insert", "Record a batch's identity before its "
                     "statement runs; nothing when it already ran.", f"""
    INSERT INTO {table} (identity, policy, policy_version, cutoff, objects)
    VALUES (:identity, :policy, :version, :cutoff, :objects)
    ON CONFLICT (identity) DO NOTHING
    RETURNING identity""")  # noqa: S608 - the table name is validated config


def ledger_done(table: str) -> Statement:
    return Statement("store_targets.ledger_done", "What a batch that already ran deleted.",
                     f"SELECT deleted FROM {table} WHERE identity = :identity")  # noqa: S608


def ledger_earlier(table: str) -> Statement:
    return Statement("store_targets.ledger_earlier", "Which of these objects earlier batches "
                     "of the policy version deleted.", f"""
    SELECT DISTINCT o FROM {table}, unnest(deleted) AS o
    WHERE policy = :policy AND policy_version = :version AND deleted && CAST(:ids AS text[])
      AND o = ANY(CAST(:ids AS text[]))""")  # noqa: S608 - the table name is validated config


def ledger_record(table: str) -> Statement:
    sql = f"UPDATE {table} SET deleted = CAST(:deleted AS text[]) WHERE identity = :identity"  # noqa: S608
    return Statement("store_targets.ledger_record", "Record what a batch's statement deleted, in "
                     "its transaction.", sql)


@dataclass(frozen=True)
class _Ledger:
    """The statements of one store's ledger table."""

    insert: Statement
    done: Statement
    earlier: Statement
    record: Statement

    @classmethod
    def of(cls, table: str) -> _Ledger:
        return cls(ledger_insert(table), ledger_done(table), ledger_earlier(table),
                   ledger_record(table))


def batch_identity(policy: Policy, cutoff: datetime, object_ids: Sequence[str]) -> str:
    """A batch's durable identity in the store: policy, version, cutoff, sorted ids."""
    digest = hashlib.sha256(f"{policy.name}\x00{policy.version}\x00{cutoff.isoformat()}"
                            .encode())
    for object_id in sorted(object_ids):
        digest.update(b"\x00" + object_id.encode())
    return digest.hexdigest()


def _answered(answer: Answer, started: float) -> CallResult:
    """A call that ended with `answer` before any statement deleted a row."""
    return CallResult(answer, (time.perf_counter() - started) * 1000, None, frozenset(), 0)


class StoreTargets:
    """Runs store targets' statements: the worker's call for a policy with a `target`."""

    def __init__(self, stores: Stores, ledger: AsyncEngine) -> None:
        self.stores = stores
        self.ledger = ledger
        self._ledgers: dict[str, _Ledger] = {}  # stores whose ledger table is known to exist
        self._statements: dict[str, Statement] = {}  # each policy's, built once
        self._cutoffs: dict[int, datetime] = {}  # batch id -> its run's cutoff

    async def delete(self, policy: Policy, leases: Sequence[Lease], *,
                     gate: SendGate | None = None) -> CallResult:
        started = time.perf_counter()
        target = policy.config.target
        assert target is not None  # the caller routes only policies with a target here
        over = await self._over_guard(policy)
        if over is not None:
            return _answered(over, started)
        try:
            groups = await self._by_cutoff(leases)
        except Exception:
            return _answered(Answer(failure=Failure.LEDGER_UNAVAILABLE), started)
        try:
            conn = await self.stores.connect(target.store)
        except StoreError as exc:
            return _answered(Answer(failure=exc.failure), started)
        if gate is not None and not gate():  # as an HTTP call's, right before it is sent
            await conn.close()
            return _answered(Answer(failure=Failure.WITHHELD), started)
        own: dict[str, Classified] = {}
        try:
            deleted = await self._delete(conn, policy, groups, own, started,
                                         alone=len(leases) == 1)
        except (StoreError, *STORE_ERRORS) as exc:
            failure = exc.failure if isinstance(exc, StoreError) \
                else failure_of(exc, connected=True)
            return _answered(Answer(failure=failure), started)
        finally:
            await conn.close()
        skipped = frozenset(lease.object_id for lease in leases) - deleted - own.keys()
        return CallResult(Answer(), (time.perf_counter() - started) * 1000, DELETED, skipped,
                          len(leases), own)

    async def _over_guard(self, policy: Policy) -> Answer | None:
        """The answer when the policy's guard is over its threshold (or could not be read):
        nothing runs and the scope closes like a 429's for the guard's backoff."""
        guard = policy.config.guard
        if guard is None:
            return None
        value = await self.stores.guard_value(guard)
        if value is None or value > guard.max:
            return Answer(failure=Failure.STORE_GUARD,
                          retry_after=str(max(1, math.ceil(guard.backoff_seconds))))
        return None

    async def _delete(self, conn: AsyncConnection, policy: Policy,
                      groups: dict[datetime, list[Lease]], own: dict[str, Classified],
                      started: float, *, alone: bool) -> frozenset[str]:
        """Run the groups' statements; a failure one row can cause is undone as a whole
        and the batch run again, split, so that one row fails alone (its outcome in
        `own`), within the share of the lease a split may use."""
        target = policy.config.target
        assert target is not None
        try:
            return await self._run(conn, policy, groups)
        except STORE_ERRORS as exc:
            if alone or one_row_failure(exc) is None or conn.invalidated:
                raise
        longest = (target.lock_timeout_ms + target.statement_timeout_ms) / 1000
        deadline = started + policy.config.lease_seconds * _SPLIT_LEASE_SHARE - longest
        return await self._run(conn, policy, groups, own=own, deadline=deadline)

    async def _by_cutoff(self, leases: Sequence[Lease]) -> dict[datetime, list[Lease]]:
        """The leases by the cutoff their statement re-checks: their batch's run's (each
        batch's read once and kept), or for items a webhook released, that moment."""
        missing = sorted({lease.batch_id for lease in leases if lease.batch_id is not None
                          and lease.batch_id not in self._cutoffs})
        if missing:
            for r in await fetch(self.ledger, _BATCH_CUTOFFS, {"ids": missing}):
                self._cutoffs[r.id] = r.cutoff
            while len(self._cutoffs) > _CUTOFF_CACHE:
                del self._cutoffs[next(iter(self._cutoffs))]
        loose = [lease.item_id for lease in leases if lease.batch_id is None]
        released = {r.id: r.cutoff for r in await fetch(
            self.ledger, _RELEASED_AT, {"ids": loose})} if loose else {}
        groups: dict[datetime, list[Lease]] = defaultdict(list)
        for lease in leases:
            cutoff = (released.get(lease.item_id) if lease.batch_id is None
                      else self._cutoffs.get(lease.batch_id))
            if cutoff is not None:  # an item or batch gone meanwhile is not deleted
                groups[cutoff].append(lease)
        return groups

    async def _run(self, conn: AsyncConnection, policy: Policy,
                   groups: dict[datetime, list[Lease]], *,
                   own: dict[str, Classified] | None = None, deadline: float = 0.0
                   ) -> frozenset[str]:
        """Delete the groups in one transaction; what was deleted. With `own`, the
        statement runs split (`_split`), and each object that failed alone gets its own
        outcome there."""
        target = policy.config.target
        assert target is not None
        store = self.stores.stores[target.store]
        if target.store not in self._ledgers:
            await self._ensure_ledger_table(conn, store)
        ledger = self._ledgers[target.store]
        statement = self._statements.get(policy.name)
        if statement is None:
            statement = self._statements[policy.name] = target_statement(target)
        deleted: set[str] = set()
        async with conn.begin():
            await limit_transaction(conn, statement_ms=target.statement_timeout_ms,
                                    lock_ms=target.lock_timeout_ms)
            for cutoff, group in groups.items():
                ids = sorted({lease.object_id for lease in group})
                identity = batch_identity(policy, cutoff, ids)
                new = (await run(conn, ledger.insert, {
                    "identity": identity, "policy": policy.name, "version": policy.version,
                    "cutoff": cutoff, "objects": len(ids)})).first()
                if new is None:  # this very batch ran and committed: its answer stands
                    deleted.update((await run(conn, ledger.done, {"identity": identity})
                                    ).scalar_one())
                    continue
                earlier: set[str] = set()
                if any(lease.attempt > 1 or lease.reclaimed for lease in group):
                    earlier = {r[0] for r in await run(conn, ledger.earlier, {
                        "ids": ids, "policy": policy.name, "version": policy.version})}
                todo = [i for i in ids if i not in earlier]
                gone: set[str] = set()
                if todo and own is None:
                    rows = await run(conn, statement, {"object_ids": todo, "cutoff": cutoff})
                    gone = {str(r.object_id) for r in rows} & set(todo)
                elif todo and own is not None:
                    gone = await self._split(conn, statement, todo, cutoff, own, deadline,
                                             whole=len(groups) > 1)
                if todo:
                    await run(conn, ledger.record, {"deleted": sorted(gone),
                                                    "identity": identity})
                deleted |= gone | earlier
        return frozenset(deleted)

    async def _split(self, conn: AsyncConnection, statement: Statement, ids: list[str],
                     cutoff: datetime, own: dict[str, Classified], deadline: float, *,
                     whole: bool) -> set[str]:
        """Run the statement on `ids` under a savepoint (`whole`; else on its halves at
        once: the whole is known to fail), splitting a part that fails on something one
        row can cause down to single rows, whose failure is theirs (`own`). Another
        failure is the batch's: raised."""
        if not whole:
            half = len(ids) // 2
            return (await self._split(conn, statement, ids[:half], cutoff, own, deadline,
                                      whole=True)
                    | await self._split(conn, statement, ids[half:], cutoff, own, deadline,
                                        whole=True))
        if time.perf_counter() > deadline:
            own.update(dict.fromkeys(ids, UNSPLIT))
            return set()
        try:
            async with conn.begin_nested():
                rows = await run(conn, statement, {"object_ids": ids, "cutoff": cutoff})
                return {str(r.object_id) for r in rows} & set(ids)
        except STORE_ERRORS as exc:
            code = one_row_failure(exc)
            if code is None:
                raise
            if len(ids) == 1:
                failure = failure_of(exc, connected=True)
                outcome = Outcome.TRANSIENT if failure is Failure.STORE_BUSY \
                    else Outcome.PERMANENT
                own[ids[0]] = Classified(outcome, f"{failure.value}:{code}")
                return set()
        return await self._split(conn, statement, ids, cutoff, own, deadline, whole=False)

    async def _ensure_ledger_table(self, conn: AsyncConnection, store: Store) -> None:
        """Create the store's ledger table if it is missing (a role without CREATE needs
        a DBA to create it first: docs/stores.md)."""
        table = store.config.ledger_table
        async with conn.begin():
            exists = (await run(conn, LEDGER_FOUND, {"t": table})).one().present
        if not exists:
            try:
                async with conn.begin():
                    await run(conn, ledger_create(table))
                    await run(conn, ledger_index(table))
            except Exception as exc:
                if sqlstate(exc) not in _CREATED_MEANWHILE:  # another worker created it
                    if failure_of(exc, connected=True) is Failure.STORE_PERMISSION:
                        raise StoreError(store.name, Failure.STORE_PERMISSION,
                                         f"cannot create {table}: {describe(exc)}") from None
                    raise
        self._ledgers[store.name] = _Ledger.of(table)
