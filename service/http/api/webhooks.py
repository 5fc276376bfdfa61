"""Storefront webhooks: `POST /v1/webhooks/{source}`, authenticated by signature (no bearer
token). The body is read from the ASGI stream up to the source's limit and no further."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Final, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from service.db.engine import is_busy, is_unavailable
from service.errors import Problem
from service.http.api.bodies import JsonRoute
from service.http.api.gate import BodyRefusal, BodyRefused, read_body
from service.http.api.problems import RETRY_AFTER_HEADER, problem_doc
from service.observability import metrics
from service.runtime import Runtime
from service.webhooks import deliveries
from service.webhooks.deliveries import DeliveryRejected, Reason
from service.webhooks.intake import Intake

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS: Final = 2  # when intake is closed: soon, the moment is usually short

# reason -> (status, problem slug, title); the 401 says nothing about which part failed
_ANSWERS: Final[dict[Reason, tuple[int, str, str]]] = {
    "signature": (401, "webhook-signature", "Signature not accepted"),
    "timestamp": (401, "webhook-signature", "Signature not accepted"),
    "malformed": (400, "malformed-webhook", "Malformed webhook"),
    "unmappable": (422, "unmappable-webhook", "Webhook cannot be mapped"),
    "too-large": (413, "payload-too-large", "Payload too large"),
    "too-slow": (408, "request-timeout", "Request body too slow"),
    "overloaded": (503, "webhook-intake-closed", "Webhook intake closed"),
    "unavailable": (503, "database-unavailable", "Database unavailable"),
}
_UNAUTHENTIC_DETAIL: Final = "the delivery could not be authenticated"
_BODY_REASONS: Final[dict[BodyRefusal, Reason]] = {
    "bad-length": "malformed", "gone": "malformed", "too-large": "too-large",
    "too-slow": "too-slow"}

@asynccontextmanager
async def _intake_lifespan(_app: Any) -> AsyncIterator[dict[str, Any]]:
    """Nested in the app's lifespan by include_router: the intake (and its pool, if one was
    opened) lives and closes with the app."""
    intake = Intake()
    try:
        yield {"webhook_intake": intake}
    finally:
        await intake.aclose()


router = APIRouter(prefix="/v1", tags=["webhooks"], route_class=JsonRoute,
                   lifespan=_intake_lifespan, responses={
    400: problem_doc("body is not JSON, or a header the scheme needs (id, topic) is missing"),
    401: problem_doc("signature missing or not valid, or the timestamp is outside the replay "
                     "window (one answer for all: nothing tells which part failed)"),
    404: problem_doc("no such webhook source"),
    408: problem_doc("the body did not arrive within SWEEPER_BODY_READ_TIMEOUT_SECONDS"),
    413: problem_doc("body over the source's max_body_bytes"),
    422: problem_doc("a matching rule found no valid tenant or object id"),
    503: problem_doc("intake closed (limit reached or database busy); retry after "
                     "Retry-After seconds", RETRY_AFTER_HEADER)})


class WebhookAnswer(BaseModel):
    """What the delivery did, committed before this answer (for a duplicate: what the first
    delivery with this webhook id did; nothing changed this time)."""

    result: Literal["applied", "ignored"] = Field(
        description="applied: rules matched the event type; ignored: no rule for it")
    duplicate: bool
    webhook_id: str
    item_ids: list[int] = Field(description="items the delivery inserted, advanced or "
                                            "released (none when it would postpone)")


_BODY_DOC: Final[dict[str, Any]] = {"requestBody": {
    "required": True,
    "description": "The storefront's JSON event, signed per the source's scheme: "
                   "standard (webhook-id, webhook-timestamp, webhook-signature), "
                   "shopify (X-Shopify-Hmac-Sha256, X-Shopify-Webhook-Id, X-Shopify-Topic), "
                   "hmac-sha256 (hex HMAC in the configured header) or header (a static "
                   "secret in the configured header).",
    "content": {"application/json": {"schema": {"type": "object"}, "examples": {
        "orders/cancelled": {
            "summary": "Shopify orders/cancelled (headers carry the topic, shop and HMAC)",
            "value": {"id": 820982911946154508, "cancel_reason": "customer",
                      "cancelled_at": "2026-11-30T10:00:00-05:00"}},
        "customers/redact": {
            "summary": "Shopify's mandatory privacy webhook",
            "value": {"shop_id": 954889, "shop_domain": "acme.myshopify.com",
                      "customer": {"id": 191167}, "orders_to_redact": [299938]}}}}}}}


@router.post("/webhooks/{source}", operation_id="receiveWebhook", status_code=202,
             response_model=WebhookAnswer, openapi_extra=_BODY_DOC,
             responses={200: {"model": WebhookAnswer,
                              "description": "ignored (no rule), or a duplicate"}})
async def receive_webhook(request: Request, source: str) -> JSONResponse:
    """Verify a storefront's signed hint, de-duplicate it by webhook id, and make the items
    its source's rules name due (now: released to workers at once). 202 when applied."""
    # straight from the lifespan state: the shared (sync) dependency would cost a thread-pool
    # round trip on the hottest write path
    runtime: Runtime = request.state.runtime
    intake: Intake = request.state.webhook_intake
    configured = runtime.policies.webhooks.get(source)
    if configured is None:
        raise Problem(404, "webhook-source-not-found", "Unknown webhook source",
                      "no webhook source of that name in the policies file")
    try:
        body = await _read_body(request, configured.config.max_body_bytes,
                                runtime.settings.body_read_timeout_seconds)
        delivery = deliveries.read_delivery(configured, runtime.policies, request.headers, body,
                                            now_s=time.time())
    except DeliveryRejected as exc:
        raise _rejected(source, exc) from None
    # The in-flight slot is taken only for a verified delivery: slow or unsigned senders
    # never hold one, so they cannot close intake for the authentic ones.
    if not intake.try_enter(runtime.settings.webhook_max_in_flight):
        raise _rejected(source, DeliveryRejected(
            "overloaded", "too many deliveries in flight; retry later"))
    try:
        # committed when it returns, maybe in one statement with deliveries waiting beside it
        receipt = await intake.apply(runtime.engine.url, runtime.settings, delivery)
    except DeliveryRejected as exc:
        raise _rejected(source, exc) from None
    except Exception as exc:
        if is_busy(exc):
            # e.g. the statement timeout cut a wait on a lock: nothing was written
            raise _rejected(source, DeliveryRejected(
                "overloaded", "the database is busy; retry later")) from None
        if not is_unavailable(exc):
            raise
        raise _rejected(source, DeliveryRejected(
            "unavailable", "the database cannot be reached; retry later")) from None
    finally:
        intake.leave()
    result = "duplicate" if receipt.duplicate else (
        "accepted" if receipt.result == "applied" else "ignored")
    metrics.WEBHOOKS.labels(source, result, "" if result != "ignored" else "no-rule").inc()
    status = 200 if receipt.duplicate or receipt.result == "ignored" else 202
    # rendered here rather than through the response model: same document, less work on
    # the hottest write path (the model still documents it)
    return JSONResponse({"result": receipt.result, "duplicate": receipt.duplicate,
                         "webhook_id": delivery.webhook_id,
                         "item_ids": list(receipt.item_ids)}, status_code=status)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, bounded in size and time like every body (`gate.read_body`)."""
    try:
        return await read_body(request.scope, request.receive, limit=limit,
                               timeout_s=timeout_s)
    except BodyRefused as exc:
        raise DeliveryRejected(_BODY_REASONS[exc.reason], exc.detail) from None


def initialise_series(sources: Iterable[str]) -> None:
    """Every source's deliveries series at 0 from start, one per result and refusal reason
    (service/observability/metrics.py `initialise_series` does the same for the rest)."""
    for source in sources:
        for result, reason in (("accepted", ""), ("duplicate", ""), ("ignored", "no-rule"),
                               *(("rejected", r) for r in _ANSWERS)):
            metrics.WEBHOOKS.labels(source, result, reason)


def _rejected(source: str, exc: DeliveryRejected) -> Problem:
    """Count the refusal and render it; never logs the body, headers or signatures."""
    metrics.WEBHOOKS.labels(source, "rejected", exc.reason).inc()
    status, slug, title = _ANSWERS[exc.reason]
    log.info("webhook rejected", extra={"source": source, "reason": exc.reason,
                                        "status": status})
    detail = _UNAUTHENTIC_DETAIL if status == 401 else exc.detail
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else None
    return Problem(status, slug, title, detail, headers=headers)


async def direct(scope: Scope, receive: Receive, send: Send, source: str) -> None:
    """`POST /v1/webhooks/{source}` as the gate calls it, past FastAPI's routing and
    dependency machinery, which the one route that takes traffic at the storefront's pace
    does not need (bench/reports/design-notes.md, HTTP and statements). The same endpoint the
    router declares (and documents), its errors answered by the app's own exception
    handlers."""
    scope["route"] = _ROUTE  # as the router would set it: the request log's label
    scope["path_params"] = {"source": source}
    request = Request(scope, receive)
    response: Response
    try:
        response = await receive_webhook(request, source)
    except Exception as exc:
        handlers = scope["app"].exception_handlers
        handler = next((handlers[c] for c in type(exc).__mro__ if c in handlers), None)
        if handler is None:
            raise
        response = await handler(request, exc)
    await response(scope, receive, send)


_ROUTE: Final[BaseRoute] = next(route for route in router.routes
                                if getattr(route, "endpoint", None) is receive_webhook)
