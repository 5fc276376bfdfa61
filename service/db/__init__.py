"""Database access: the async engine, the embedded server, migrations, table definitions."""
