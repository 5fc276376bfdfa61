"""The worker's call port with per-tenant credentials: a lookup that fails sends nothing and
punishes no item."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

from service.budget.credential_waits import Credentials
from service.ledger.claims import Lease
from service.outcomes import Failure, Outcome, classify
from service.upstreams.deletion_api import Upstreams
from service.worker.upstream_calls import UpstreamCalls
from tests.conftest import policies_from


class BrokenStore:
    async def get(self, tenant_id: str, upstream: str) -> str | None:
        raise ConnectionError("database unreachable")


async def test_a_failed_credential_lookup_is_not_sent_and_not_punished(tmp_path: Path
                                                                       ) -> None:
    policies = policies_from({
        "upstreams": {"api": {"base_url": "http://127.0.0.1:9", "credentials": {"api": True},
                              "headers": {"Authorization": "Bearer {credential}"}}},
        "policies": {"p": {"version": 1, "upstream": "api", "path": "/c/{object_id}",
                           "scope": "t:{tenant_id}", "rate": {"per_second": 1}}}})
    upstreams = Upstreams(policies.upstreams)
    calls = UpstreamCalls(upstreams, Credentials({"api": BrokenStore()}))
    lease = Lease(1, "acme", "c1", "p", 1, "k" * 64, "t:acme", uuid.uuid4(), 1,
                  datetime.now(UTC))
    try:
        result = await calls.delete(policies.policies["p"], lease)
    finally:
        await upstreams.aclose()
    assert result.answer.failure is Failure.CREDENTIAL_UNAVAILABLE
    verdict = classify(result.answer, absent_means_deleted=False, now=datetime.now(UTC))
    assert verdict.outcome is Outcome.THROTTLED  # refunded, the scope backs off
