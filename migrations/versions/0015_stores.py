"""The store's own database as source and target.

- `skipped`: an item whose row no longer matched the target statement's predicate when its
  batch ran (active again since discovery). A terminal status and an outcome class; a later
  discovery that finds the row matching again re-arms the item.
- `discoveries`: one row per (run, source policy): the keyset cursor of the source query and
  what discovery counted, advanced in the transaction that registers the page's items, so a
  crash resumes from the last committed page and registers nothing twice.
- `discovery_tenants`: per tenant, the candidates discovery found, with the oldest and newest
  age (the report-only figures per tenant).
- `scopes.closed_reason`: why a scope is closed (a 429, a guard on the store), for
  `GET /v1/scopes`.
- `items_skipped`: retention prunes skipped items by age.

The CHECKs are replaced NOT VALID and then validated: the validation takes only a SHARE
UPDATE EXCLUSIVE lock, so a large ledger keeps serving while it runs.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_OUTCOMES = ("'succeeded', 'throttled', 'transient', 'unknown', 'permanent', 'unauthorized'")
_STATUSES = "'pending', 'leased', 'succeeded', 'dead', 'cancelled'"
_TERMINAL = "'succeeded', 'dead', 'cancelled'"


def _checks(outcomes: str, statuses: str, terminal: str) -> list[str]:
    return [
        "ALTER TABLE items DROP CONSTRAINT items_status_check",
        f"ALTER TABLE items ADD CONSTRAINT items_status_check CHECK (status IN ({statuses})) "
        "NOT VALID",
        "ALTER TABLE items DROP CONSTRAINT items_completed_at",
        f"ALTER TABLE items ADD CONSTRAINT items_completed_at CHECK ((status IN ({terminal})) "
        "= (completed_at IS NOT NULL)) NOT VALID",
        "ALTER TABLE items DROP CONSTRAINT items_last_outcome_check",
        f"ALTER TABLE items ADD CONSTRAINT items_last_outcome_check CHECK (last_outcome IN "
        f"({outcomes})) NOT VALID",
        "ALTER TABLE attempts DROP CONSTRAINT attempts_outcome_check",
        f"ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check CHECK (outcome IN "
        f"({outcomes})) NOT VALID",
        "ALTER TABLE items VALIDATE CONSTRAINT items_status_check",
        "ALTER TABLE items VALIDATE CONSTRAINT items_completed_at",
        "ALTER TABLE items VALIDATE CONSTRAINT items_last_outcome_check",
        "ALTER TABLE attempts VALIDATE CONSTRAINT attempts_outcome_check",
    ]


UPGRADE = (
    *_checks(_OUTCOMES + ", 'skipped'", _STATUSES + ", 'skipped'", _TERMINAL + ", 'skipped'"),
    """
CREATE TABLE discoveries (
    run_id        bigint NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    policy        text NOT NULL,
    -- the keyset cursor: the last row of the last committed page (NULL: none read yet)
    after_age     timestamptz,
    after_tenant  text,
    after_object  text,
    pages         integer NOT NULL DEFAULT 0,
    candidates    bigint NOT NULL DEFAULT 0,
    registered    bigint NOT NULL DEFAULT 0,
    errors        bigint NOT NULL DEFAULT 0,
    -- the first few malformed rows' problems (never their ids' text beyond a prefix)
    error_samples jsonb NOT NULL DEFAULT '[]',
    oldest_age    timestamptz,
    newest_age    timestamptz,
    done          boolean NOT NULL DEFAULT false,
    -- why the last page could not be read (the store unreachable, a refused query)
    failure       text,
    started_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, policy)
)""",
    """
CREATE TABLE discovery_tenants (
    run_id      bigint NOT NULL,
    policy      text NOT NULL,
    tenant_id   text NOT NULL,
    candidates  bigint NOT NULL,
    oldest_age  timestamptz NOT NULL,
    newest_age  timestamptz NOT NULL,
    PRIMARY KEY (run_id, policy, tenant_id),
    FOREIGN KEY (run_id, policy) REFERENCES discoveries (run_id, policy) ON DELETE CASCADE
)""",
    "ALTER TABLE scopes ADD COLUMN closed_reason text",
    # retention prunes skipped items by age (service/cluster/retention.py); on a large ledger create
    # it by hand first, CONCURRENTLY, as 0003 says of items_finished
    "CREATE INDEX IF NOT EXISTS items_skipped ON items (completed_at) WHERE status = 'skipped'",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP INDEX items_skipped")
    op.execute("DROP TABLE discovery_tenants")
    op.execute("DROP TABLE discoveries")
    op.execute("ALTER TABLE scopes DROP COLUMN closed_reason")
    op.execute("DELETE FROM attempts WHERE outcome = 'skipped'")
    op.execute("UPDATE items SET status = 'cancelled', last_outcome = NULL "
               "WHERE status = 'skipped'")
    for statement in _checks(_OUTCOMES, _STATUSES, _TERMINAL):
        op.execute(statement)
