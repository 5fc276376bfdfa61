"""The call port on the upstreams' HTTP clients (service/upstreams/deletion_api.py) and the
stores' statements (service/sweeps/store_targets.py): each lease's tenant credential looked
up first, a batch call keyed by `calls.batch_key`."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from service.budget.credential_waits import Credentials
from service.config.policies import Policy
from service.ledger.claims import Lease
from service.outcomes import Answer, Failure
from service.protocols.transport import SendGate
from service.sweeps.store_targets import StoreTargets
from service.upstreams.deletion_api import CallResult, Upstreams
from service.worker.calls import batch_key

log = logging.getLogger("service.worker")


class UpstreamCalls:
    """Calls through the pooled HTTP clients of the policies' upstreams, with the tenant's
    credential where the upstream takes one per tenant."""

    def __init__(self, upstreams: Upstreams, credentials: Credentials | None = None,
                 targets: StoreTargets | None = None) -> None:
        self.upstreams = upstreams
        self.credentials = credentials or Credentials({})
        self.targets = targets  # the policies with a store target: a statement, not a call

    async def delete(self, policy: Policy, lease: Lease, *, send_by: float | None = None,
                     gate: SendGate | None = None) -> CallResult:
        if policy.config.target is not None:
            return await self.delete_batch(policy, [lease], send_by=send_by, gate=gate)
        found = await self._credential(policy, lease)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).delete(
            policy, tenant_id=lease.tenant_id, object_id=lease.object_id,
            operation_key=lease.operation_key, object_version=lease.object_version,
            credential=found, send_by=send_by, gate=gate)

    async def confirm(self, policy: Policy, lease: Lease, *, send_by: float | None = None,
                      gate: SendGate | None = None) -> CallResult:
        found = await self._credential(policy, lease)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).confirm(
            policy, tenant_id=lease.tenant_id, object_id=lease.object_id,
            object_version=lease.object_version, credential=found, send_by=send_by,
            gate=gate)

    async def delete_batch(self, policy: Policy, leases: Sequence[Lease], *,
                           send_by: float | None = None, gate: SendGate | None = None
                           ) -> CallResult:
        if policy.config.target is not None:
            if self.targets is None:  # a process wired without its stores: a bug
                raise RuntimeError(f"policy {policy.name!r} has a store target and this "
                                   "process has no stores")
            # a statement, not a request: the gate alone applies (as an HTTP call's, right
            # before it is sent); its lateness was checked when the call started
            return await self.targets.delete(policy, leases, gate=gate)
        first = leases[0]
        found = await self._credential(policy, first)
        if isinstance(found, CallResult):
            return found
        return await self.upstreams.for_policy(policy).delete(
            policy, tenant_id=first.tenant_id, object_id="",
            operation_key=batch_key(policy, leases), credential=found,
            object_ids=[lease.object_id for lease in leases], send_by=send_by, gate=gate)

    async def _credential(self, policy: Policy, lease: Lease) -> str | CallResult | None:
        """The tenant's credential (None: the upstream takes none, or it has none), or the
        result of a call that cannot be made because its lookup failed."""
        upstream = policy.config.upstream
        if upstream not in self.credentials.upstreams:
            return None
        try:
            return await self.credentials.get(lease.tenant_id, upstream)
        except Exception as exc:  # the store's database: nothing was sent
            log.warning("credential lookup failed; the call waits",
                        extra={"scope": lease.scope, "error": type(exc).__name__})
            return CallResult(Answer(failure=Failure.CREDENTIAL_UNAVAILABLE), 0.0)
