"""Storefront webhooks: signed, de-duplicated hints that make cleanup due sooner.

A webhook is a hint, never the owner of deletion state: the item is in the ledger and the
next run finds it by age, so a missed webhook loses nothing. A delivery goes through

    read_delivery   verify the signature over the raw body (signatures.py), then parse it,
                    find the webhook id and the event type, and map the source's rules for
                    that type to hints (policy, tenant, object id, due now or later)
    receipts.record one atomic statement: the receipt (unique per source and webhook id)
                    and the hints' effect on items, or nothing at all for a duplicate

Errors, each with a reason from the closed set metrics use:

    DeliveryRejected(reason)
        signature, timestamp    not authentic or outside the replay window (401)
        malformed               not a JSON object, or a header the scheme needs is missing (400)
        unmappable              a matching rule's tenant or object id is absent or invalid (422)
        too-large               over the source's max_body_bytes (413)
        too-slow                the body did not arrive in time (408)
        overloaded              intake limit reached or no database connection in time (503)
        unavailable             the database cannot be reached (503)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from service.config.policies import Policies, Policy, WebhookSource
from service.config.policy_file import WebhookRule, parse_body_path, parse_duration
from service.ledger import registration
from service.protocols import webhook_signatures

Reason = Literal["signature", "timestamp", "malformed", "unmappable", "too-large",
                 "too-slow", "overloaded", "unavailable"]

MAX_WEBHOOK_ID_CHARS: Final = 512
MAX_EVENT_TYPE_CHARS: Final = 200
BODY_DIGEST_PREFIX: Final = "sha256:"


class DeliveryRejected(Exception):
    """A delivery Sweeper refuses; nothing was written. `detail` never holds a value taken
    from the request (it may be customer data) and never says which signature part failed."""

    def __init__(self, reason: Reason, detail: str | None = None) -> None:
        super().__init__(reason)
        self.reason: Reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Hint:
    """Make this obligation due: now (`delay_seconds` None) or that long after the event."""

    policy: Policy
    tenant_id: str
    object_id: str
    delay_seconds: float | None


@dataclass(frozen=True)
class Delivery:
    """A verified delivery and what its source's rules make of it (no hints: ignored)."""

    source: str
    webhook_id: str
    event_type: str
    event_at: int | None  # Unix seconds, only where the scheme signs a timestamp
    hints: tuple[Hint, ...]


# -- reading a delivery (no I/O) -------------------------------------------------------------


def read_delivery(source: WebhookSource, policies: Policies, headers: Mapping[str, str],
                  body: bytes, *, now_s: float) -> Delivery:
    """Verify, parse and map one delivery; DeliveryRejected when it cannot be accepted."""
    cfg = source.config
    try:
        webhook_signatures.verify(cfg.scheme, webhook_signatures.keys_for(cfg.scheme,
                                                                          source.secrets),
                                  headers, body, now_s=now_s, tolerance_s=cfg.tolerance_seconds,
                                  signature_header=cfg.signature_header)
        verified_at = (int(headers["webhook-timestamp"]) if cfg.scheme == "standard"
                       else None)
    except webhook_signatures.SignatureRejected as exc:
        raise DeliveryRejected(exc.reason) from None
    payload = _parse_json(body)
    event_type = _event_type(source, headers, payload)
    hints = tuple(_hint(i, rule, policies, headers, payload)
                  for i, rule in enumerate(cfg.rules) if rule.topic == event_type)
    return Delivery(source=source.name, webhook_id=_webhook_id(source, headers, body),
                    event_type=event_type, event_at=verified_at, hints=hints)


def _parse_json(body: bytes) -> dict[str, Any]:
    """The event: a JSON object, as the contract says (every storefront sends one)."""
    try:
        event = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise DeliveryRejected("malformed", "the body is not valid JSON") from None
    if not isinstance(event, dict):
        raise DeliveryRejected("malformed", "the body must be a JSON object")
    return event


def _printable(value: str, limit: int) -> bool:
    return 0 < len(value) <= limit and all(" " < c <= "~" for c in value)


def _required_header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name.lower())
    if not value:
        raise DeliveryRejected("malformed", f"the {name} header is missing")
    return value


def _webhook_id(source: WebhookSource, headers: Mapping[str, str], body: bytes) -> str:
    cfg = source.config
    if cfg.scheme == "standard":
        value, name = _required_header(headers, "webhook-id"), "webhook-id"
    elif cfg.scheme == "shopify":
        value = _required_header(headers, "X-Shopify-Webhook-Id")
        name = "X-Shopify-Webhook-Id"
    elif cfg.id_header:
        value, name = _required_header(headers, cfg.id_header), cfg.id_header
    else:
        # no id header configured: the same body twice is the same delivery
        return BODY_DIGEST_PREFIX + hashlib.sha256(body).hexdigest()
    if not _printable(value, MAX_WEBHOOK_ID_CHARS):
        raise DeliveryRejected("malformed", f"the {name} header must be 1 to "
                                            f"{MAX_WEBHOOK_ID_CHARS} printable ASCII characters")
    return value


def _event_type(source: WebhookSource, headers: Mapping[str, str], payload: Any) -> str:
    cfg = source.config
    header = ("X-Shopify-Topic" if cfg.scheme == "shopify" else cfg.topic_header
              if cfg.scheme in ("hmac-sha256", "header") else None)
    if header is not None:
        value, where = _required_header(headers, header), f"the {header} header"
    else:
        path = cfg.topic_path or "type"
        found, where = _at(payload, path), f'the body\'s "{path}"'
        if not isinstance(found, str):
            raise DeliveryRejected("malformed", f"{where} must be a string")
        value = found
    if not _printable(value, MAX_EVENT_TYPE_CHARS):
        raise DeliveryRejected("malformed", f"{where} must be 1 to {MAX_EVENT_TYPE_CHARS} "
                                            "printable ASCII characters")
    return value


def extract(extractor: str, headers: Mapping[str, str], payload: Any) -> str | None:
    """A rule's `header:Name` or `body:path` value as an id string; None when absent or not
    a string or integer."""
    kind, _, where = extractor.partition(":")
    if kind == "header":
        return headers.get(where.lower()) or None
    value = _at(payload, where)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) else None


def _at(payload: Any, path: str) -> Any:
    """The value at a body path (`customer.id`, `line_items[0].id`); None where it leads
    nowhere."""
    value = payload
    for step in parse_body_path(path):
        if isinstance(step, int):
            value = value[step] if isinstance(value, list) and step < len(value) else None
        else:
            value = value.get(step) if isinstance(value, dict) else None
    return value


def _hint(index: int, rule: WebhookRule, policies: Policies, headers: Mapping[str, str],
          payload: Any) -> Hint:
    policy = policies.policy(rule.policy)
    assert policy is not None  # resolve_policies refuses rules naming unknown policies
    ids: dict[str, str] = {}
    for field, extractor in (("tenant", rule.tenant), ("object_id", rule.object_id)):
        value = extract(extractor, headers, payload)
        problem = ("is missing or not a string or integer" if value is None
                   else registration.id_problem(value))
        if problem:
            raise DeliveryRejected("unmappable", f"rules[{index}] (topic {rule.topic!r}): "
                                                 f"{field} from {extractor} {problem}")
        assert value is not None
        ids[field] = value
    ids["tenant"] = policy.tenant(ids["tenant"])  # its one spelling (service/config/tenants.py)
    ids["object_id"] = policy.object_id(ids["object_id"])
    problem = policy.object_id_problem(ids["object_id"])
    if problem:
        raise DeliveryRejected("unmappable", f"rules[{index}] (topic {rule.topic!r}): "
                                             f"object_id from {rule.object_id} {problem}")
    request = policy.request
    problem = request.host_problem(ids["tenant"], ids["object_id"]) if request else None
    if problem and request is not None:
        field, extractor = (("tenant", rule.tenant) if request.host_field == "tenant_id"
                            else ("object_id", rule.object_id))
        raise DeliveryRejected("unmappable", f"rules[{index}] (topic {rule.topic!r}): "
                                             f"{field} from {extractor} {problem}")
    delay = None if rule.due == "now" else parse_duration(rule.due).total_seconds()
    return Hint(policy=policy, tenant_id=ids["tenant"], object_id=ids["object_id"],
                delay_seconds=delay)
