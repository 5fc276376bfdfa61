"""The rate budget every replica shares: the token buckets and closures in PostgreSQL (`limiter`),
what one upstream answer does to its scope (`answer_effects`), operator controls of scopes
(`scope_controls`), pauses that end by themselves (`pauses`) and scopes waiting for a
tenant's credential (`credential_waits`).
"""
