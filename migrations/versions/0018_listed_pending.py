"""The operators' index of pending items serves only the statements that say so.

0017's `items_pending (id) WHERE status = 'pending'` could serve any statement on pending
items, and the planner took it for the claim whenever its statistics counted almost no
pending rows (a quiet ledger analysed before a run released its backlog, which is the usual
order: autoanalyze waits for a tenth of the table to change). The claim then read every
pending row of the scope and sorted them for each claim: 60 ms a claim at 50,000 released
items against 0.6 ms on `items_ready` (1,000,000 finished rows, EXPLAIN ANALYZE). The pick
of due items and the waiting scopes' probe could take it the same way.

`items_listed` holds the same entries under the predicate `status = 'pending' AND id > 0`.
`id > 0` is true of every row (ids are an identity from 1); only the operators' reads state
it (`ledger.FILTER_SQL`), so no other statement can be planned on this index, whatever the
statistics say.

On a ledger that is already large, create it by hand first, without blocking writes
(`CREATE INDEX CONCURRENTLY IF NOT EXISTS items_listed ...` as below, then
`DROP INDEX CONCURRENTLY items_pending`); this migration then finds it and skips it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS items_listed ON items (id) "
               "WHERE status = 'pending' AND id > 0")
    op.execute("DROP INDEX IF EXISTS items_pending")


def downgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS items_pending ON items (id) "
               "WHERE status = 'pending'")
    op.execute("DROP INDEX items_listed")
