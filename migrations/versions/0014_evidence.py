"""Deletion evidence that outlives the ledger.

When retention prunes a succeeded item, its evidence moves here in the same statement:
tenant, object, policy and version, operation key, outcome, upstream status, attempts,
completion time and the run whose batch released it; never a payload. It is kept for
SWEEPER_EVIDENCE_RETENTION_DAYS after completion (service/cluster/retention.py), answers
`GET /v1/evidence` (by tenant and object id) and joins the run's export.

`item_id` is the pruned item's id: the key of an export's order, and unique.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = (
    """
CREATE TABLE evidence (
    item_id         bigint PRIMARY KEY,
    run_id          bigint,
    tenant_id       text NOT NULL,
    object_id       text NOT NULL,
    policy          text NOT NULL,
    policy_version  integer NOT NULL,
    operation_key   text NOT NULL,
    outcome         text NOT NULL,
    upstream_status smallint,
    attempts        integer NOT NULL,
    completed_at    timestamptz NOT NULL,
    kept_at         timestamptz NOT NULL DEFAULT now()
)""",
    "CREATE INDEX evidence_object ON evidence (tenant_id, object_id)",
    "CREATE INDEX evidence_run ON evidence (run_id, item_id) WHERE run_id IS NOT NULL",
    "CREATE INDEX evidence_completed ON evidence (completed_at)",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE evidence")
