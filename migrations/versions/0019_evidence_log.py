"""Deletion evidence as an append-only log, chained as it is written.

`evidence_log`: one row per completion that recorded deletions (a *segment*), whatever
released the items (a run's batch, a webhook hint, a re-drive, a store target, a list
source), appended by that completion (claims._COMPLETE) in the same statement. Its entries
are numbered seq_start .. seq_end in the whole log, with no gap; `records` holds each
entry's canonical bytes (service/evidence/deletion_records.py: identifiers and classified outcomes,
never a payload), each preceded by its length (4 bytes, big-endian); `hash` is the chain
after the segment: SHA-256(hash of the segment before || SHA-256 of each entry's canonical
bytes, in order), the genesis digest before the first. One row per completion rather than
per deletion: a row, its index entry and their WAL headers per deletion made the drain
measurably slower (bench/reports/2026-12-04-evidence-log). `runs`: the run ids among its
entries, for a run's export (GIN).

`evidence_log_head`: one row, the log's size and last hash. A completion locks it while
it appends (after it has updated its items), so appends are serialised and the chain has
one order.

`evidence_checkpoints`: signed (size, head hash, time) statements, as transparency logs
publish signed tree heads, at segment ends: the first past every CHECKPOINT_RECORDS
entries, the head at a fixed interval of time when the log grew, and before an export.

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
    seq_end   bigint PRIMARY KEY,
    seq_start bigint NOT NULL,
    runs      bigint[] NOT NULL,
    records   bytea NOT NULL,
    hash      bytea NOT NULL CHECK (octet_length(hash) = 32),
    CONSTRAINT evidence_log_seq CHECK (seq_start >= 1 AND seq_end >= seq_start)
)""",
    "CREATE INDEX evidence_log_runs ON evidence_log USING gin (runs)",
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
)


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE evidence_checkpoints")
    op.execute("DROP TABLE evidence_log_head")
    op.execute("DROP TABLE evidence_log")
