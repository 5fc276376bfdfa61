"""Batch sequence numbers come from a sequence, so a run can publish in parallel.

A batch's `seq` orders it within its run (unique per run). It was the run's batch count
plus one, read from the run row that the single publisher held locked. Publication now runs
two chunk transactions side by side (each PostgreSQL backend spends about 30 us per released
row on index inserts, so one backend was the limit), and they cannot both count on the run
row: `seq` is drawn from `batches_seq`, which is increasing and never handed out twice, and
takes no lock.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SEQUENCE IF NOT EXISTS batches_seq AS integer MINVALUE 0 START 0")
    # runs already published keep their seq values; new batches start above all of them
    op.execute("SELECT setval('batches_seq', coalesce((SELECT max(seq) + 1 FROM batches), 0),"
               " false)")


def downgrade() -> None:
    op.execute("DROP SEQUENCE batches_seq")
