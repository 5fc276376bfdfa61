"""Deletion evidence as an append-only log, chained as it is written.

`evidence_log`: one entry per deletion, whatever released the item (a run's batch, a
webhook hint, a re-drive, a store target, a list source), appended by the completion that
records it (claims._COMPLETE) in the same statement. `seq` numbers entries 1, 2, ... with
no gap; `hash` is the chain after the entry: sha256(hash of seq - 1 || leaf), where the
leaf is the SHA-256 of the entry's canonical record (service/evidence_log.py) and the
hash before seq 1 is the genesis digest. Identifiers and classified outcomes only, never a
payload.

`evidence_log_head`: one row, the log's size and last hash. A completion locks it while
it appends (after it has updated its items), so appends are serialised and the chain has
one order.

`evidence_checkpoints`: signed (size, head hash, time) statements, as transparency logs
publish signed tree heads; made at every CHECKPOINT_RECORDS entries, at a fixed interval
of time when the log grew, and before an export.

`evidence_chain(leaf, start)`: the chain as an aggregate, so one statement chains a whole
flush with a window over its entries (`start` is the head before it). Its step is PL/pgSQL:
an aggregate never inlines a SQL function, and PL/pgSQL's simple-expression path costs
about half as much per entry.

Deletions recorded before this revision are not in the log (their run exports held them
under the previous format); the log starts empty at genesis.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UPGRADE = (
    """
CREATE TABLE evidence_log (
    seq             bigint PRIMARY KEY CHECK (seq > 0),
    item_id         bigint NOT NULL,
    run_id          bigint,
    released_by     text NOT NULL CHECK (released_by IN ('run', 'webhook')),
    tenant_id       text NOT NULL,
    object_id       text NOT NULL,
    policy          text NOT NULL,
    policy_version  integer NOT NULL,
    operation_key   text NOT NULL,
    outcome         text NOT NULL,
    upstream_status smallint,
    attempts        integer NOT NULL,
    completed_at    timestamptz NOT NULL,
    hash            bytea NOT NULL CHECK (octet_length(hash) = 32)
)""",
    # BRIN: a run's entries lie close together in the log, and an entry appended past the
    # last summarised range costs this index nothing (a B-tree entry per deletion would:
    # bench/reports/2026-12-04-evidence-log)
    "CREATE INDEX evidence_log_run ON evidence_log USING brin (run_id)",
    """
CREATE TABLE evidence_log_head (
    id   smallint PRIMARY KEY CHECK (id = 1),
    size bigint NOT NULL CHECK (size >= 0),
    hash bytea NOT NULL CHECK (octet_length(hash) = 32)
)""",
    """
INSERT INTO evidence_log_head (id, size, hash)
VALUES (1, 0, sha256(convert_to('sweeper-evidence-log/1 genesis', 'UTF8')))""",
    """
CREATE TABLE evidence_checkpoints (
    size      bigint PRIMARY KEY CHECK (size >= 0),
    hash      bytea NOT NULL CHECK (octet_length(hash) = 32),
    signed_at timestamptz NOT NULL,
    key_id    text,
    signature text
)""",
    """
CREATE FUNCTION evidence_chain_step(state bytea, leaf bytea, start bytea) RETURNS bytea
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS 'BEGIN RETURN sha256(coalesce(state, start) || leaf); END'""",
    """
CREATE AGGREGATE evidence_chain(bytea, bytea) (
    SFUNC = evidence_chain_step, STYPE = bytea
)""",
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP AGGREGATE evidence_chain(bytea, bytea)")
    op.execute("DROP FUNCTION evidence_chain_step(bytea, bytea, bytea)")
    op.execute("DROP TABLE evidence_checkpoints")
    op.execute("DROP TABLE evidence_log_head")
    op.execute("DROP TABLE evidence_log")
