"""Regions: `items.region`, where an item may be processed (service/config/regions.py), set
when the item is written from the policies file's `[regions]` pins and re-pinned at start
when the pins change (service/ledger/region_pins.py). NULL: the tenant is pinned nowhere.
Claims of both execution modes compare it with the claimer's SWEEPER_REGION.

Locks: ACCESS EXCLUSIVE on items for a moment (a nullable column, no rewrite; the CHECK is
NOT VALID, so no scan: it holds for every row written from now on, and every row before
is NULL). The partial index (open pinned items only) is empty until tenants are pinned;
its build takes a SHARE lock while it scans items: on a large ledger create it by hand
first (`CREATE INDEX CONCURRENTLY IF NOT EXISTS ...` as below); this migration then skips
it.

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
    op.execute("ALTER TABLE items ADD COLUMN region text")
    op.execute("ALTER TABLE items ADD CONSTRAINT items_region_check "
               "CHECK (region ~ '^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$') NOT VALID")
    op.execute("CREATE INDEX IF NOT EXISTS items_pinned ON items (tenant_id) "
               "WHERE region IS NOT NULL AND status IN ('pending', 'skipped')")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS items_pinned")
    op.execute("ALTER TABLE items DROP COLUMN region")
