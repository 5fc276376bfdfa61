"""Sweeper: scheduled, rate-limited, crash-safe data cleanup backed by a PostgreSQL ledger."""

__version__ = "0.1.0"
