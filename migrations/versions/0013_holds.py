"""Legal holds: while one is active, no item it covers is leased.

A hold names a tenant and optionally a policy and either object ids or an object-id
prefix. `items.hold_id` marks the items a hold covers (service/ledger/holds.py sets it when a hold
is placed and when an item is registered under one, and clears it at release), and
`items_ready` leaves marked items out, so a held backlog costs claims nothing. The
admission statement also checks the active holds themselves: see service/ledger/holds.py for why
both are needed.

`items.hold_id` has no foreign key (holds are never deleted, and the item writes on the hot
path should not probe another table). Adding a nullable column without a default is a
catalog change; rebuilding `items_ready` reads the claimable rows once and blocks item
writes while it does, as 0008's rebuild did.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# the same rules as 0001's identifiers and policy names
_IDENT = "octet_length({c}) BETWEEN 1 AND 512 AND {c} !~ '[[:cntrl:]]'"
_POLICY = "{c} ~ '^[a-z0-9][a-z0-9_.-]{{0,62}}$'"

UPGRADE = (
    f"""
CREATE TABLE holds (
    id                 bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id          text NOT NULL CHECK ({_IDENT.format(c="tenant_id")}),
    policy             text CHECK ({_POLICY.format(c="policy")}),
    object_ids         text[] CHECK (cardinality(object_ids) BETWEEN 1 AND 1000),
    object_id_prefix   text CHECK ({_IDENT.format(c="object_id_prefix")}),
    reason             text NOT NULL CHECK (char_length(reason) BETWEEN 1 AND 1000),
    reference          text NOT NULL CHECK (char_length(reference) BETWEEN 1 AND 200),
    expires_at         timestamptz,
    placed_by          text NOT NULL,
    placed_at          timestamptz NOT NULL DEFAULT now(),
    effective_at       timestamptz,
    items_held         bigint NOT NULL DEFAULT 0 CHECK (items_held >= 0),
    in_flight          integer NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
    in_flight_item_ids bigint[] NOT NULL DEFAULT '{{}}',
    released_at        timestamptz,
    released_by        text,
    release_why        text CHECK (char_length(release_why) BETWEEN 1 AND 1000),
    CONSTRAINT holds_one_selector CHECK (object_ids IS NULL OR object_id_prefix IS NULL),
    CONSTRAINT holds_release CHECK ((released_at IS NULL) = (released_by IS NULL)
                                    AND (released_at IS NULL) = (release_why IS NULL))
)""",
    "CREATE INDEX holds_active ON holds (tenant_id) WHERE released_at IS NULL",
    "ALTER TABLE items ADD COLUMN hold_id bigint",
    "CREATE INDEX items_held ON items (hold_id) WHERE hold_id IS NOT NULL",
    "DROP INDEX items_ready",
    "CREATE INDEX items_ready ON items (scope, (coalesce(batch_id, 0)), id) "
    "WHERE status = 'pending' AND released_at IS NOT NULL AND hold_id IS NULL",
)


def upgrade() -> None:
    # exec_driver_sql: SQLAlchemy would read [[:cntrl:]] as a bind parameter (see 0001)
    for statement in UPGRADE:
        op.get_bind().exec_driver_sql(statement)


def downgrade() -> None:
    op.execute("DROP INDEX items_ready")
    op.execute("CREATE INDEX items_ready ON items (scope, (coalesce(batch_id, 0)), id) "
               "WHERE status = 'pending' AND released_at IS NOT NULL")
    op.execute("ALTER TABLE items DROP COLUMN hold_id")
    op.execute("DROP TABLE holds")
