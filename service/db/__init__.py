"""Database access: the async engine, the embedded server, migrations, table definitions,
statements and how they run, and the notification that wakes idle workers (`wakeups`)."""
