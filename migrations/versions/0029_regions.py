"""Regions: `items.region`, where an item may be processed (service/config/regions.py), set
when the item is written from the policies file's `[regions]` pins and moved at start when
the pins change (service/ledger/region_pins.py, which records the pins it applied last in
`region_pins`). NULL: the tenant is pinned nowhere. Claims of both execution modes compare
it with the claimer's SWEEPER_REGION.

Locks: the migrations run in one transaction, so the ACCESS EXCLUSIVE lock that adding the
column takes (no rewrite: a nullable column; the CHECK is NOT VALID, so no scan: every row
before is NULL) is held until the end, while the partial index `items_pinned` (items in a
region, none until tenants are pinned) scans the table too. On a large ledger run these
first, each its own short transaction, and the migration then skips them:

    ALTER TABLE items ADD COLUMN IF NOT EXISTS region text;
    CREATE INDEX CONCURRENTLY IF NOT EXISTS items_pinned ON items (tenant_id)
        WHERE region IS NOT NULL;

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-05
"""

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE items ADD COLUMN IF NOT EXISTS region text")
    op.execute("""
        DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'items_region_check')
            THEN ALTER TABLE items ADD CONSTRAINT items_region_check
                 CHECK (region ~ '^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$') NOT VALID;
            END IF;
        END $$""")
    op.execute("CREATE INDEX IF NOT EXISTS items_pinned ON items (tenant_id) "
               "WHERE region IS NOT NULL")
    op.execute("""
        CREATE TABLE region_pins (
            id smallint PRIMARY KEY CHECK (id = 1),
            digest text NOT NULL,
            applied_at timestamptz NOT NULL
        )""")


def downgrade() -> None:
    op.execute("DROP TABLE region_pins")
    op.execute("DROP INDEX IF EXISTS items_pinned")
    op.execute("ALTER TABLE items DROP COLUMN region")
