"""Object-id holds as an index, and holds that bind at the send.

`hold_objects` holds one row per (tenant, object id, hold) of
every active hold that names object ids, so the checks that run item by item (registration
marking a new item, the admission, the eligible counts) find the holds naming an object with
one primary-key probe, whatever the number of holds and ids. Before, each check walked every
active hold of the tenant and compared the item with each hold's array (300 holds of 1,000
ids: 300,000 comparisons an item).

`holds.object_ids` stays the hold's record (the API's answer, the audit trail). Rows go with
the hold's release. `holds_whole` indexes the active holds that name no object ids (a
tenant, a policy, a prefix), the other half of each check. Filled from the active holds.

`hold_acks`: a worker process's word that it knows a hold (service/worker/hold_gate.py):
from then on it starts no call the hold covers, and `revoked` names the covered calls it
had leased but not started, which it hands back. A hold answers once every worker holding a
covered lease has acknowledged it or that lease has run out (service/ledger/holds.py).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-04
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

UPGRADE = (
    """
CREATE TABLE hold_objects (
    tenant_id text NOT NULL,
    object_id text NOT NULL,
    hold_id   bigint NOT NULL REFERENCES holds (id),
    PRIMARY KEY (tenant_id, object_id, hold_id)
)""",
    "CREATE INDEX hold_objects_hold ON hold_objects (hold_id)",
    """
CREATE TABLE hold_acks (
    hold_id  bigint NOT NULL REFERENCES holds (id),
    worker   text NOT NULL,
    revoked  bigint[] NOT NULL DEFAULT '{}',
    acked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (hold_id, worker)
)""",
    "CREATE INDEX holds_whole ON holds (tenant_id) "
    "WHERE released_at IS NULL AND object_ids IS NULL",
    """
INSERT INTO hold_objects (tenant_id, object_id, hold_id)
SELECT DISTINCT h.tenant_id, o.object_id, h.id
FROM holds h, unnest(h.object_ids) AS o(object_id)
WHERE h.released_at IS NULL AND h.object_ids IS NOT NULL""",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE hold_acks")
    op.execute("DROP INDEX holds_whole")
    op.execute("DROP TABLE hold_objects")
