"""SQLAlchemy Core tables mirroring the migrations (the migrations are the source of truth;
tests/integration/test_schema.py fails if the two drift apart)."""

from __future__ import annotations

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID

metadata = MetaData()


def _ts(name: str, nullable: bool = False) -> Column[object]:
    return Column(name, DateTime(timezone=True), nullable=nullable)


scopes = Table(
    "scopes",
    metadata,
    Column("name", Text, primary_key=True),
    Column("rate_per_second", Float, nullable=False),
    Column("burst", Integer, nullable=False),
    Column("tokens", Float, nullable=False),
    _ts("refilled_at"),
    _ts("closed_until", nullable=True),
    Column("backoff_level", Integer, nullable=False),
    Column("paused", Boolean, nullable=False),
    Column("paused_reason", Text),
    Column("weight", Integer, nullable=False),
    Column("budget_from_policy", Boolean, nullable=False),
    Column("ready_after_batch", BigInteger, nullable=False),
    Column("ready_after_id", BigInteger, nullable=False),
    _ts("front_scanned_at", nullable=True),
    _ts("created_at"),
    _ts("updated_at"),
    Column("objects_per_call", Integer, nullable=False),  # a batch policy's (0012)
    Column("closed_reason", Text),  # why closed_until was set (0015)
)

runs = Table(
    "runs",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("trigger_key", Text, unique=True),
    Column("request_digest", Text, nullable=False),
    Column("policy", Text),
    Column("tenant_id", Text),
    _ts("cutoff"),
    Column("dry_run", Boolean, nullable=False),
    Column("max_items", BigInteger),
    Column("state", Text, nullable=False),
    Column("candidates", BigInteger, nullable=False),
    Column("released", BigInteger, nullable=False),
    Column("batches", Integer, nullable=False),
    Column("remaining", BigInteger, nullable=False),
    _ts("oldest_due_at", nullable=True),
    _ts("newest_due_at", nullable=True),
    Column("report", JSONB, nullable=False),
    Column("error", Text),
    _ts("created_at"),
    _ts("published_at", nullable=True),
    Column("trace_parent", Text),  # the triggering request's W3C traceparent (0025)
)

discoveries = Table(
    "discoveries",
    metadata,
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("policy", Text, primary_key=True),
    _ts("after_age", nullable=True),
    Column("after_tenant", Text),
    Column("after_object", Text),
    Column("pages", Integer, nullable=False),
    Column("candidates", BigInteger, nullable=False),
    Column("registered", BigInteger, nullable=False),
    Column("errors", BigInteger, nullable=False),
    Column("error_samples", JSONB, nullable=False),
    _ts("oldest_age", nullable=True),
    _ts("newest_age", nullable=True),
    Column("done", Boolean, nullable=False),
    Column("failure", Text),
    _ts("started_at"),
    _ts("updated_at"),
)

discovery_tenants = Table(
    "discovery_tenants",
    metadata,
    Column("run_id", BigInteger, primary_key=True),
    Column("policy", Text, primary_key=True),
    Column("tenant_id", Text, primary_key=True),
    Column("candidates", BigInteger, nullable=False),
    _ts("oldest_age"),
    _ts("newest_age"),
    ForeignKeyConstraint(["run_id", "policy"], ["discoveries.run_id", "discoveries.policy"],
                         ondelete="CASCADE"),
)

batches = Table(
    "batches",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("run_id", BigInteger, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("digest", Text, nullable=False, unique=True),
    Column("policy", Text, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("item_count", Integer, nullable=False),
    _ts("created_at"),
    _ts("enqueued_at", nullable=True),  # handed to the broker (migration 0028)
    UniqueConstraint("run_id", "seq"),
)

items = Table(
    "items",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("object_id", Text, nullable=False),
    Column("policy", Text, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("operation_key", Text, nullable=False),  # unique with the obligation (0004)
    Column("scope", Text, nullable=False),
    Column("status", Text, nullable=False),
    _ts("due_at"),
    _ts("next_attempt_at"),
    Column("attempts", Integer, nullable=False),
    _ts("released_at", nullable=True),
    Column("batch_id", BigInteger),  # no key: see migration 0007
    Column("lease_owner", Text),
    Column("lease_token", UUID(as_uuid=True)),
    _ts("lease_expires_at", nullable=True),
    Column("last_outcome", Text),
    Column("last_status_code", SmallInteger),
    Column("last_error", Text),
    Column("dead_reason", Text),
    _ts("created_at"),
    _ts("updated_at"),
    _ts("completed_at", nullable=True),
    Column("object_version", Text),  # named by a conflict answer (0011)
    Column("hold_id", BigInteger),  # the legal hold holding it (0013; no key)
    # its deletion answered success; its next claim reads whether the object is gone (0023)
    Column("confirming", Boolean, nullable=False),
    # when the last attempt's call started: a success has no attempt row (0024)
    _ts("last_started_at", nullable=True),
    Column("trace_parent", Text),  # what released it: its batch's or delivery's (0025)
    Column("region", Text),  # where it may be processed; NULL: anywhere unpinned (0029)
    UniqueConstraint("tenant_id", "object_id", "policy", "policy_version",
                     name="items_obligation"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("item_id", BigInteger, ForeignKey("items.id", ondelete="CASCADE"), nullable=False),
    Column("attempt_no", Integer, nullable=False),
    Column("worker", Text, nullable=False),
    Column("lease_token", UUID(as_uuid=True), nullable=False),
    _ts("started_at"),
    _ts("finished_at"),
    Column("outcome", Text, nullable=False),
    Column("http_status", SmallInteger),
    Column("retry_after_seconds", Float),
    Column("latency_ms", Float, nullable=False),
    Column("error_code", Text),
    Column("fenced", Boolean, nullable=False),
)

webhook_receipts = Table(
    "webhook_receipts",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("source", Text, nullable=False),
    Column("webhook_id", Text, nullable=False),
    Column("event_type", Text),
    Column("result", Text, nullable=False),
    Column("item_ids", ARRAY(BigInteger), nullable=False),
    _ts("received_at"),
    _ts("enqueued_at", nullable=True),  # handed to the broker (migration 0028)
    UniqueConstraint("source", "webhook_id", name="webhook_receipts_once"),
)

# operators' re-drives waiting for the broker (migration 0028: service/execution/outbox.py)
requeues = Table(
    "requeues",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("item_ids", ARRAY(BigInteger), nullable=False),
    _ts("created_at"),
    _ts("enqueued_at", nullable=True),
)

holds = Table(
    "holds",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("tenant_id", Text, nullable=False),
    Column("policy", Text),
    Column("object_ids", ARRAY(Text)),
    Column("object_id_prefix", Text),
    Column("reason", Text, nullable=False),
    Column("reference", Text, nullable=False),
    _ts("expires_at", nullable=True),
    Column("placed_by", Text, nullable=False),
    _ts("placed_at"),
    _ts("effective_at", nullable=True),
    Column("items_held", BigInteger, nullable=False),
    Column("in_flight", Integer, nullable=False),
    Column("in_flight_item_ids", ARRAY(BigInteger), nullable=False),
    _ts("released_at", nullable=True),
    Column("released_by", Text),
    Column("release_why", Text),
    _ts("enqueued_at", nullable=True),  # its items handed to the broker (migration 0028)
)

hold_objects = Table(
    "hold_objects",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("object_id", Text, primary_key=True),
    Column("hold_id", BigInteger, ForeignKey("holds.id"), primary_key=True),
)

hold_acks = Table(
    "hold_acks",
    metadata,
    Column("hold_id", BigInteger, ForeignKey("holds.id"), primary_key=True),
    Column("worker", Text, primary_key=True),
    Column("revoked", ARRAY(BigInteger), nullable=False),
    _ts("acked_at"),
)

evidence = Table(
    "evidence",
    metadata,
    Column("item_id", BigInteger, primary_key=True, autoincrement=False),
    Column("run_id", BigInteger),
    Column("tenant_id", Text, nullable=False),
    Column("object_id", Text, nullable=False),
    Column("policy", Text, nullable=False),
    Column("policy_version", Integer, nullable=False),
    Column("operation_key", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("upstream_status", SmallInteger),
    Column("attempts", Integer, nullable=False),
    _ts("completed_at"),
    _ts("kept_at"),
)

# the append-only evidence log (a row per completion's segment), its head and its signed
# checkpoints (0019)
evidence_log = Table(
    "evidence_log",
    metadata,
    Column("seq_end", BigInteger, primary_key=True, autoincrement=False),
    Column("seq_start", BigInteger, nullable=False),
    Column("runs", ARRAY(BigInteger), nullable=False),
    Column("records", BYTEA, nullable=False),
    Column("hash", BYTEA, nullable=False),
)

evidence_log_head = Table(
    "evidence_log_head",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("size", BigInteger, nullable=False),
    Column("hash", BYTEA, nullable=False),
)

evidence_checkpoints = Table(
    "evidence_checkpoints",
    metadata,
    Column("size", BigInteger, primary_key=True, autoincrement=False),
    Column("hash", BYTEA, nullable=False),
    _ts("signed_at"),
    Column("key_id", Text),
    Column("signature", Text),
)

operator_actions = Table(
    "operator_actions",
    metadata,
    Column("id", BigInteger, primary_key=True),
    _ts("at"),
    Column("actor", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("reason", Text),
    Column("details", JSONB, nullable=False),
)

# the pins items were last moved to (migration 0029: service/ledger/region_pins.py)
region_pins = Table(
    "region_pins",
    metadata,
    Column("id", SmallInteger, primary_key=True),
    Column("digest", Text, nullable=False),
    _ts("applied_at"),
)

control = Table(
    "control",
    metadata,
    Column("singleton", Boolean, primary_key=True),
    Column("workers_paused", Boolean, nullable=False),
    Column("paused_reason", Text),
    _ts("updated_at"),
)

tenant_credentials = Table(
    "tenant_credentials",
    metadata,
    Column("tenant_id", Text, primary_key=True),
    Column("upstream", Text, primary_key=True),
    Column("key_id", Text, nullable=False),
    Column("nonce", BYTEA, nullable=False),
    Column("ciphertext", BYTEA, nullable=False),
    Column("fingerprint", Text, nullable=False),
    _ts("updated_at"),
    Column("updated_by", Text, nullable=False),
)

console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id", Text, primary_key=True),
    Column("actor", Text, nullable=False),
    _ts("created_at"),
    _ts("expires_at"),
    _ts("ended_at", nullable=True),
)

console_key = Table(
    "console_key",
    metadata,
    Column("singleton", Boolean, primary_key=True),
    Column("key", BYTEA, nullable=False),
)

leader = Table(
    "leader",
    metadata,
    Column("name", Text, primary_key=True),
    Column("holder", Text, nullable=False),
    Column("term", BigInteger, nullable=False),
    _ts("elected_at"),
    _ts("expires_at"),
)


def _counts(*names: str) -> list[Column[object]]:
    return [Column(name, Integer, nullable=False) for name in names]


# the console's minutes (0026): counts added by upserts, the backlog sampled by the leader
policy_minutes = Table(
    "policy_minutes",
    metadata,
    Column("minute", DateTime(timezone=True), primary_key=True),
    Column("policy", Text, primary_key=True),
    *_counts("succeeded", "throttled", "transient", "unknown", "permanent", "unauthorized",
             "skipped", "dead", "fenced", "reclaimed", "closures"),
    Column("eligible", Integer),
    Column("oldest_eligible_s", Float),
)

scope_minutes = Table(
    "scope_minutes",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("minute", DateTime(timezone=True), primary_key=True),
    Column("policy", Text, primary_key=True),
    *_counts("calls", "succeeded", "throttled", "closures", "reclaimed"),
)

batch_minutes = Table(
    "batch_minutes",
    metadata,
    Column("batch_id", BigInteger, ForeignKey("batches.id", ondelete="CASCADE"),
           primary_key=True),
    Column("minute", DateTime(timezone=True), primary_key=True),
    *_counts("succeeded", "dead", "skipped"),
)
