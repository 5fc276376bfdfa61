"""HTTP routers: they translate HTTP to domain calls and back, and hold no SQL (but the
readiness probe's one query)."""
