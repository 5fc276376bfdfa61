"""A retention policy as the policies file declares it, resolved: its keys checked together
(its store parts in service/config/stores.py, the upstreams and stores it names in
service/config/file_entries.py), its deletion call, confirmation read and list call compiled
under its upstream's origin, and its answer rules compiled.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from service.config import store_statements
from service.config.answer_rules import NO_RULES, AnswerRules, compile_rules
from service.config.list_sources import ListRequest, ListSourceConfig, compile_list_request
from service.config.placeholders import TemplateProblems, template_fields
from service.config.policy_file import PolicyConfig, SourceConfig, parse_duration
from service.config.regions import Regions
from service.config.request_templates import RequestTemplate, compile_request
from service.config.resolution import Resolution
from service.config.stores import store_problems
from service.config.tenants import host_form
from service.config.upstreams import Upstream


@dataclass(frozen=True)
class Policy:
    """A resolved policy, ready for the worker and the publisher."""

    name: str
    config: PolicyConfig
    # what each HTTP call sends; None for a policy whose target is a store's database
    request: RequestTemplate | None = field(repr=False, compare=False)
    answers: AnswerRules = field(default=NO_RULES, repr=False, compare=False)  # how it is read
    # an HTTP list source's call and how its answers are read (None: no such source)
    listing: ListRequest | None = field(default=None, repr=False, compare=False)
    list_answers: AnswerRules = field(default=NO_RULES, repr=False, compare=False)
    # the confirmation read's call (None: the policy's deletions are not confirmed)
    confirm_request: RequestTemplate | None = field(default=None, repr=False, compare=False)
    # the file's regions (the same for every policy): where its items may be processed
    regions: Regions = field(default_factory=Regions, repr=False, compare=False)

    def region(self, tenant_id: str) -> str | None:
        """The region this tenant's items are pinned to (None: none)."""
        return self.regions.of_tenant(tenant_id)

    def confirms(self, operation_key: str) -> bool:
        """Whether the deletion of the item with `operation_key` is confirmed by a read:
        its key's place in [0, 1) under the policy's `confirm.share`, so every attempt of
        the item (and every replica) decides the same."""
        confirm = self.config.confirm
        if confirm is None or confirm.share <= 0.0:
            return False
        if confirm.share >= 1.0:
            return True
        drawn = int.from_bytes(hashlib.sha256(operation_key.encode()).digest()[:8], "big")
        return drawn < confirm.share * 2.0**64

    @property
    def store_source(self) -> SourceConfig | None:
        """The policy's store source, if its candidates come from a store's query."""
        source = self.config.source
        return source if isinstance(source, SourceConfig) else None

    @property
    def list_source(self) -> ListSourceConfig | None:
        """The policy's HTTP list source, if an upstream lists its candidates."""
        source = self.config.source
        return source if isinstance(source, ListSourceConfig) else None

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def target_name(self) -> str:
        """The upstream it calls, or the store its statement runs on."""
        cfg = self.config
        return cfg.target.store if cfg.target is not None else str(cfg.upstream)

    @property
    def per_call(self) -> int:
        """How many objects one call (one HTTP request, one statement) carries at most."""
        return self.config.batch.max_objects if self.config.batch is not None else 1

    @cached_property
    def tenant_in_host(self) -> bool:
        """Whether its calls' host (deletion or list calls) is built from the tenant id."""
        return any(call is not None and call.origin.tenant_in_host
                   for call in (self.request, self.listing))

    def tenant(self, tenant_id: str) -> str:
        """The tenant id as this policy's items are stored, compared and sent: its canonical
        host form where it makes a host (service/config/tenants.py), else exactly as given."""
        return host_form(tenant_id) if self.tenant_in_host else tenant_id

    @cached_property
    def object_id_type(self) -> str | None:
        """The type a store target's statement casts its ids to (`CAST(:object_ids AS
        bigint[])`), None for any other policy: an id it cannot take is refused when it
        is registered or discovered, never left to fail its batch."""
        target = self.config.target
        return store_statements.ids_type(target.statement) if target is not None else None

    def object_id_problem(self, object_id: str) -> str | None:
        """Why this policy's target could never take `object_id`, or None."""
        kind = self.object_id_type
        return None if kind is None else store_statements.id_type_problem(kind, object_id)

    def object_id(self, object_id: str) -> str:
        """The object id as this policy's items are stored, compared and sent: lower-cased
        where the upstream treats ids case-insensitively (`object_id_case`)."""
        return object_id.lower() if self.config.object_id_case == "insensitive" else object_id

    def scope_for(self, tenant_id: str) -> str:
        """The limiter scope an item of this policy and tenant draws budget from."""
        return self.config.scope.format(
            tenant_id=tenant_id, upstream=self.target_name, policy=self.name
        )


def resolve_policy(name: str, pol: PolicyConfig, upstreams: Mapping[str, Upstream],
                   r: Resolution) -> Policy | None:
    """The policy `name` resolved against the upstreams that compiled (those with problems
    of their own too, so that its checks against them still run), or None when it has a
    problem; each is noted in `r`. A problem stops only the checks it makes meaningless."""
    key, mark = f"policies.{name}", r.mark()
    store_problems(key, pol, r)
    if pol.target is not None and pol.object_id_case == "insensitive":
        r.fail(f"{key}.object_id_case", "a store target's statement compares ids as its "
                                        "column does: \"insensitive\" is for HTTP upstreams")
    if pol.backoff.max_seconds < pol.backoff.base_seconds:
        r.fail(f"{key}.backoff.max_seconds", "must be at least base_seconds")
    listing = _listing(key, name, pol, upstreams, r)
    if pol.target is not None:
        return None if r.found_since(mark) else Policy(name=name, config=pol, request=None,
                                                       **listing)
    _batch_problems(key, pol, r)
    _budget_problems(key, pol, r)
    if pol.upstream is None:
        r.fail(key, "name an upstream (and its path) to call, or a store target = { store "
                    "= ..., statement = ... }")
        return None
    upstream = upstreams.get(pol.upstream)
    if upstream is not None:
        _upstream_problems(key, pol, upstream, r)
    if pol.path is None:
        r.fail(f"{key}.path", "required key is missing (the path the upstream is called at)")
    if upstream is None or pol.path is None:
        return None  # an undeclared upstream is noted by file_entries.reference_problems
    calls = _calls(key, name, pol, upstream, pol.path, r)
    if calls is None or r.found_since(mark):
        return None
    request, confirm_request = calls
    return Policy(name=name, config=pol, request=request, confirm_request=confirm_request,
                  answers=compile_rules(
                      pol.answers, pol.answer_max_bytes,
                      actual_cost=pol.cost.actual if pol.cost else None,
                      available_cost=pol.cost.available if pol.cost else None,
                      failed_ids=pol.batch.failed if pol.batch else None),
                  **listing)


def _upstream_problems(key: str, pol: PolicyConfig, upstream: Upstream,
                       r: Resolution) -> None:
    """The checks of an HTTP policy against the upstream it calls."""
    # The call's deadline must end before the lease does, or a slow upstream would let a
    # second worker reclaim an item whose first call is still in flight.
    if upstream.config.timeout_seconds >= pol.lease_seconds:
        r.fail(f"{key}.lease_seconds", f"must be longer than upstream {pol.upstream!r} "
                                       f"timeout_seconds ({upstream.config.timeout_seconds})")
    if upstream.per_tenant_credentials and "tenant_id" not in template_fields(pol.scope):
        # one tenant without a credential pauses its scope: never other tenants' items
        r.fail(f"{key}.scope", f"upstream {pol.upstream!r} has per-tenant credentials: the "
                               "scope must contain {tenant_id}")


def _batch_problems(key: str, pol: PolicyConfig, r: Resolution) -> None:
    """A batch of one scope's objects per call: one tenant's, one policy's, unconfirmed."""
    if pol.batch is not None and pol.confirm is not None:
        r.fail(f"{key}.confirm", "a confirmation reads one object, and a policy with "
                                 "batch deletes many per call: not supported together "
                                 "(drop batch to confirm its deletions)")
    if pol.batch is not None and not {"tenant_id", "policy"} <= template_fields(pol.scope):
        # a call is one scope's objects: one tenant's, sent with one policy's template
        r.fail(f"{key}.scope", "a policy with batch needs a scope holding {tenant_id} and "
                               "{policy}, e.g. \"{policy}:{tenant_id}\"")


def _budget_problems(key: str, pol: PolicyConfig, r: Resolution) -> None:
    """An HTTP call's budget: in calls, or in points with the cost of a call."""
    if pol.rate.unit == "rows":
        r.fail(f"{key}.rate.unit", "a budget in rows is for a store target's statement")
    elif (pol.rate.unit == "points") != (pol.cost is not None):
        r.fail(f"{key}.cost" if pol.cost is None else f"{key}.rate.unit",
               "a budget in points needs the cost of a call: cost = { requested = ... }"
               if pol.cost is None else "a call's cost counts against a budget in "
               "points: rate = { ..., unit = \"points\" }")
    elif pol.cost is not None and pol.cost.requested > pol.rate.burst:
        r.fail(f"{key}.cost.requested", f"a call costs more than the burst "
                                        f"({pol.rate.burst} points): no call could start")


def _calls(key: str, name: str, pol: PolicyConfig, upstream: Upstream, path: str,
           r: Resolution) -> tuple[RequestTemplate, RequestTemplate | None] | None:
    """The deletion call and the confirmation read (None: not confirmed) compiled under the
    upstream's origin, or None when either cannot be; problems are noted in `r` (a call
    that does not compile still has its confirmation read compiled)."""
    request = None
    try:
        request = compile_request(upstream.origin, policy=name, version=pol.version,
                                  path=path, body=pol.body, batch=pol.batch is not None)
    except TemplateProblems as exc:
        r.fail_template(key, exc)
    else:
        for i, answer in enumerate(pol.answers):
            if answer.version is not None and not request.uses_object_version:
                r.fail(f"{key}.answers[{i}].version", "the request must carry "
                                                      "{object_version} for a retry to use it")
    confirm_request = None
    if pol.confirm is not None and pol.batch is None:
        try:
            confirm_request = compile_request(upstream.origin, policy=name,
                                              version=pol.version, path=pol.confirm.path)
        except TemplateProblems as exc:
            r.fail_template(f"{key}.confirm", exc)
            return None
    return None if request is None else (request, confirm_request)


def _listing(key: str, name: str, pol: PolicyConfig, upstreams: Mapping[str, Upstream],
             r: Resolution) -> dict[str, Any]:
    """A policy's HTTP list source compiled (`listing` and `list_answers` for its Policy),
    or nothing; problems go to `r`. The list calls draw from the policy's scope of each
    tenant, so per-tenant credentials need a scope per tenant."""
    source = pol.source
    if not isinstance(source, ListSourceConfig):
        return {}
    at = f"{key}.source"
    try:
        older_than = parse_duration(source.older_than)
    except ValueError as exc:
        r.fail(f"{at}.older_than", str(exc))
        return {}
    upstream = upstreams.get(source.upstream)
    if upstream is None:  # undeclared, or not compiled: its own problems are noted
        return {}
    if (upstream.per_tenant_credentials or len(source.tenants) > 1) and \
            "tenant_id" not in template_fields(pol.scope):
        # each tenant's list calls draw from, close and pause its own scope
        r.fail(f"{key}.scope", "a list source of several tenants (or with per-tenant "
                               "credentials) needs a scope holding {tenant_id}")
    try:
        request = compile_list_request(upstream.origin, source, policy=name,
                                       older_than=older_than)
    except TemplateProblems as exc:
        r.fail_template(at, exc)
        return {}
    return {"listing": request, "list_answers": compile_rules(source.answers,
                                                              source.max_bytes)}
