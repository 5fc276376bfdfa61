"""Operator console sessions.

`console_sessions` holds one row per signed-in browser: the digest of the cookie's secret
(never the secret), the operator (the API token's actor name it signed in with), and when it
expires or was signed out. `console_key` holds the one key every replica signs cookies and
CSRF tokens with, made here from the server's strong random source (gen_random_uuid), so a
forged or garbled cookie is refused without a database read.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UPGRADE = (
    """
CREATE TABLE console_sessions (
    id          text PRIMARY KEY CHECK (id ~ '^[0-9a-f]{64}$'),
    actor       text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    ended_at    timestamptz
)""",
    "CREATE INDEX console_sessions_expires ON console_sessions (expires_at)",
    """
CREATE TABLE console_key (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key       bytea NOT NULL CHECK (length(key) = 32)
)""",
    "INSERT INTO console_key (key) "
    "VALUES (uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()))",
)

DOWNGRADE = ("DROP TABLE console_key", "DROP TABLE console_sessions")


def upgrade() -> None:
    for statement in UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    for statement in DOWNGRADE:
        op.execute(statement)
