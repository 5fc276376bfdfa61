"""items leave two fifths of each new page free (fillfactor 60, was 80): room for a whole
admission's claims of the items on one page to be HOT updates.

An admission claims items in batch order, and items registered together sit on the same
pages: one statement leases most of a page's rows at once, and a row version left by a
claim cannot be pruned before that statement commits. At fillfactor 80 a page had room for
four or five of its twenty-odd rows' new versions; the rest of the claims were non-HOT, a
new entry in each of the row's indexes and a new page for the row. `bench itemcost`
(bench/reports/2026-12-05-item-cost): WAL per drained item 1,261-1,268 -> 994-996 bytes,
the claims' HOT share up, and the table after a drain smaller (601 -> 548 bytes per item),
since fewer updates move a row to a new page.

Locks: SHARE UPDATE EXCLUSIVE for a moment (a storage parameter; no rewrite, no scan).
Pages written before keep what they have; new ones are filled to 60%.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05
"""

from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items SET (fillfactor = 60)")


def downgrade() -> None:
    op.execute("ALTER TABLE items SET (fillfactor = 80)")
