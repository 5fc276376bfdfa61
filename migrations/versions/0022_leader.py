"""The cluster's leader: one row per duty group, held by one process under a lease.

`leader` names the process (`holder`) that runs the cluster's once-only loops (publication,
holds maintenance, retention: service/cluster/leader.py), its `term` (raised at every election, so
a statement written for an older term can tell it is no longer the leader's) and when its
lease ends on the database clock (`expires_at`). A holder renews its lease well before that;
any process takes over a lease that has lapsed.

Revision ID: 0022
Revises: 0020
Create Date: 2026-12-04
"""

from alembic import op

revision = "0022"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
CREATE TABLE leader (
    name       text PRIMARY KEY,
    holder     text NOT NULL,
    term       bigint NOT NULL,
    elected_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
)""")


def downgrade() -> None:
    op.execute("DROP TABLE leader")
