"""Per-tenant upstream credentials, encrypted at rest.

One row per (tenant, upstream): the secret sealed with AES-256-GCM (a 12-byte nonce, the
ciphertext with its 16-byte tag), the id of the key that sealed it, and a fingerprint
operators compare (service/credentials/crypto.py). The database never holds a secret in
the clear, so a dump, a replica or a backup gives none away without the key.

Bounds as elsewhere in the ledger: the tenant id as items' (1..512 bytes, no control
characters), the upstream as a policies-file name, a secret of at most 8192 bytes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# the same rules as 0001's identifiers and 0006's names, without counted repetition
_IDENT = "octet_length({c}) BETWEEN 1 AND 512 AND {c} !~ '[[:cntrl:]]'"
_HEX = "octet_length({c}) = {n} AND {c} !~ '[^0-9a-f]'"

UPGRADE = f"""
CREATE TABLE tenant_credentials (
    tenant_id   text NOT NULL CHECK ({_IDENT.format(c="tenant_id")}),
    upstream    text NOT NULL CHECK (octet_length(upstream) BETWEEN 1 AND 63
                                     AND upstream ~ '^[a-z0-9]' AND upstream !~ '[^a-z0-9_.-]'),
    key_id      text NOT NULL CHECK ({_HEX.format(c="key_id", n=16)}),
    nonce       bytea NOT NULL CHECK (octet_length(nonce) = 12),
    -- at least one byte of secret, at most 8192, each with the 16-byte tag
    ciphertext  bytea NOT NULL CHECK (octet_length(ciphertext) BETWEEN 17 AND 8208),
    fingerprint text NOT NULL CHECK ({_HEX.format(c="fingerprint", n=12)}),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    updated_by  text NOT NULL CHECK ({_IDENT.format(c="updated_by")}),
    PRIMARY KEY (tenant_id, upstream)
)
"""


def upgrade() -> None:
    # exec_driver_sql: SQLAlchemy would read [[:cntrl:]] as a bind parameter (see 0001)
    op.get_bind().exec_driver_sql(UPGRADE)


def downgrade() -> None:
    op.execute("DROP TABLE tenant_credentials")
