"""The rate budget every replica shares: its rules, pure (`rules`: budgets in tokens, grants,
late tolerance, closures, fair shares), the token buckets and closures in PostgreSQL
(`buckets`), what one upstream answer does to its scope (`answer_effects`, pure), operator
controls of scopes (`scope_controls`) and scopes waiting for a tenant's credential
(`credential_waits`). The pure modules never import the database's: a call's result goes
down from the worker to `answer_effects` and `rules`, and the worker applies their verdict
through `buckets`.
"""
