"""The console's pages: overview, runs, items, scopes, webhooks and the audit trail. They
read through the same domain functions as the API (and its shared caches); lists page by
keyset. The forms they show post to service/http/console/actions.py."""

from __future__ import annotations

import math
from typing import Any, Final

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from service.budget import scope_controls
from service.config.policies import Policies
from service.http.api.bodies import MAX_BIGINT
from service.http.api.runs import evidence_export
from service.http.console.render import ConsoleError, page
from service.http.console.sessions import Session
from service.http.console.web import (
    DEFAULT_WINDOW,
    PREFIX,
    ConsoleRoute,
    Form,
    Params,
    console_of,
    context,
    runtime_of,
    signed_in,
    whole_number,
    window_of,
)
from service.ledger import item_selection, operator_reads
from service.runs import discovery, progress

router = APIRouter(prefix=PREFIX, route_class=ConsoleRoute, include_in_schema=False)

PAGE_SIZE: Final = 50
ITEM_STATUSES: Final = ("pending", "leased", "succeeded", "dead", "cancelled", "skipped")
RUN_STATES: Final = ("publishing", "published", "failed")
RECEIPT_RESULTS: Final = ("applied", "ignored")
ITEM_FILTERS: Final = ("status", "policy", "tenant_id", "object_id", "reason")


@router.get("")
async def overview(request: Request) -> Response:
    session = await signed_in(request)
    window = window_of(Params(request, ("window",)))
    runtime = runtime_of(request)
    return page("overview.html", {
        **await context(request, session, "overview"),
        "view": await console_of(request).overview.get(runtime),
        "policies": sorted(runtime.policies.policies), "window": window})


@router.get("/overview/live")
async def overview_live(request: Request) -> Response:
    """The overview's figures alone, which the page fetches every few seconds."""
    session = await signed_in(request)
    Params(request, ())
    view = await console_of(request).overview.get(runtime_of(request))
    return page("overview_live.html", {**await context(request, session, "overview"),
                                       "view": view})


@router.get("/runs")
async def run_list(request: Request) -> Response:
    session = await signed_in(request)
    runtime = runtime_of(request)
    params = Params(request, ("policy", "state", "kind", "before"))
    filters = {"policy": params.choice("policy", runtime.policies.policies),
               "state": params.choice("state", RUN_STATES),
               "kind": params.choice("kind", ("report-only", "real"))}
    before = params.number("before")
    kind = filters["kind"]
    rows = await progress.list_runs(runtime.engine, limit=PAGE_SIZE, before=before,
                                    progress=runtime.run_progress, policy=filters["policy"],
                                    state=filters["state"],
                                    dry_run=None if kind is None else kind == "report-only",
                                    attempts=False)
    return page("runs.html", {
        **await context(request, session, "runs"), "runs": rows, "filters": filters,
        "policies": sorted(runtime.policies.policies), "states": RUN_STATES,
        "next_before": rows[-1]["id"] if len(rows) == PAGE_SIZE else None})


def path_id(value: str, what: str) -> int:
    """A path's id: a whole number from 1, else a 404 page naming `what`."""
    number = whole_number(value)
    if number is None or not 1 <= number <= MAX_BIGINT:
        raise ConsoleError(404, f"No such {what}", f"{what} ids are whole numbers from 1")
    return number


async def run_or_404(request: Request, run_id: int) -> dict[str, Any]:
    runtime = runtime_of(request)
    run = await progress.run_status(runtime.engine, run_id, runtime.run_progress)
    if run is None:
        raise ConsoleError(404, "No such run", f"there is no run {run_id}")
    return run


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: str) -> Response:
    session = await signed_in(request)
    Params(request, ())
    run = await run_or_404(request, path_id(run_id, "run"))
    found = await discovery.report(runtime_of(request).engine, int(str(run["id"])))
    return page("run.html", {**await context(request, session, "runs"), "run": run,
                             "discovery": found,
                             "evidence_signed": runtime_of(request).signer is not None})


@router.get("/runs/{run_id}/live")
async def run_live(request: Request, run_id: str) -> Response:
    """A run's progress alone, which its page fetches every few seconds."""
    session = await signed_in(request)
    Params(request, ())
    run = await run_or_404(request, path_id(run_id, "run"))
    return page("run_live.html", {**await context(request, session, "runs"), "run": run})


@router.get("/runs/{run_id}/evidence")
async def run_evidence(request: Request, run_id: str) -> Response:
    await signed_in(request)
    Params(request, ())
    number = path_id(run_id, "run")
    response = await evidence_export(runtime_of(request), number)
    if response is None:
        raise ConsoleError(404, "No such run", f"there is no run {number}")
    response.headers["Content-Disposition"] = (
        f'attachment; filename="sweeper-run-{number}-evidence.jsonl"')
    return response


def item_filter(values: Params | Form, policies: Policies
                ) -> tuple[dict[str, str | None], item_selection.ItemFilter]:
    """The items filter a page or form names, checked (object ids need their tenant: the
    obligation index finds them by both; the tenant in its stored spelling)."""
    shown = {"status": values.choice("status", ITEM_STATUSES),
             "policy": values.choice("policy", policies.policies),
             "tenant_id": values.string("tenant_id", 512),
             "object_id": values.string("object_id", 512),
             "reason": values.string("reason", 200)}
    if shown["object_id"] is not None and shown["tenant_id"] is None:
        raise ConsoleError(422, "Tenant needed", "searching by object id needs the tenant id "
                                                 "too")
    tenant_id, object_id = shown["tenant_id"], shown["object_id"]
    try:
        if tenant_id is not None:
            tenant_id = policies.tenant(tenant_id, shown["policy"])
        if object_id is not None:
            object_id = policies.object_id(object_id, shown["policy"])
    except ValueError as exc:
        raise ConsoleError(422, "Id not in its stored form",
                           f"the tenant or object id {exc}") from None
    return shown, item_selection.ItemFilter(policy=shown["policy"], tenant_id=tenant_id,
                                            object_id=object_id, reason=shown["reason"])


@router.get("/items")
async def item_list(request: Request) -> Response:
    session = await signed_in(request)
    runtime = runtime_of(request)
    params = Params(request, (*ITEM_FILTERS, "after"))
    shown, item_filter_ = item_filter(params, runtime.policies)
    after = params.number("after", low=0)
    rows = await item_selection.list_items(runtime.engine, status=shown["status"],
                                           item_filter=item_filter_, after=after,
                                           limit=PAGE_SIZE)
    return page("items.html", {
        **await context(request, session, "items"), "items": rows, "filters": shown,
        "policies": sorted(runtime.policies.policies), "statuses": ITEM_STATUSES,
        "next_after": rows[-1]["id"] if len(rows) == PAGE_SIZE else None})


@router.get("/items/{item_id}")
async def item_page(request: Request, item_id: str) -> Response:
    session = await signed_in(request)
    Params(request, ())
    number = path_id(item_id, "item")
    engine = runtime_of(request).engine
    found = await operator_reads.item(engine, number)
    if found is None:
        raise ConsoleError(404, "No such item", f"there is no item {number}")
    return page("item.html", {**await context(request, session, "items"), "item": found,
                              "attempts": await operator_reads.attempts(engine, number)})


@router.get("/scopes")
async def scope_list(request: Request) -> Response:
    session = await signed_in(request)
    params = Params(request, ("after",))
    after = params.string("after", 1_000)
    rows = await scope_controls.list_scopes(runtime_of(request).engine, after=after,
                                            limit=PAGE_SIZE)
    return page("scopes.html", {
        **await context(request, session, "scopes"), "scopes": rows,
        "workers": await scope_controls.workers_state(runtime_of(request).engine),
        "next_after": rows[-1]["name"] if len(rows) == PAGE_SIZE else None})


@router.get("/scope")
async def scope_page(request: Request) -> Response:
    """One scope by name (a query parameter: names may hold '/')."""
    session = await signed_in(request)
    params = Params(request, ("name", "window"))
    name = params.string("name", 1_000)
    if name is None:
        raise ConsoleError(422, "No scope named", "name the scope: ?name=...")
    return await scope_view(request, session, name, {}, 200, window=window_of(params))


async def scope_view(request: Request, session: Session, name: str,
                     form: dict[str, object], status: int,
                     errors: list[str] | None = None, window: str = DEFAULT_WINDOW
                     ) -> Response:
    """A scope's page, with what a refused form held and why (the budget form), its
    chart over `window`."""
    rows = await scope_controls.list_scopes(runtime_of(request).engine, name=name, limit=1)
    if not rows:
        raise ConsoleError(404, "No such scope", "there is no scope by that name")
    return page("scope.html", {**await context(request, session, "scopes"),
                               "scope": rows[0], "form": form, "errors": errors or [],
                               "window": window},
                status=status)


@router.get("/webhooks")
async def webhook_list(request: Request) -> Response:
    session = await signed_in(request)
    runtime = runtime_of(request)
    params = Params(request, ("source", "result", "before"))
    filters = {"source": params.string("source", 200),
               "result": params.choice("result", RECEIPT_RESULTS)}
    before = params.number("before")
    rows = await operator_reads.receipts(runtime.engine, source=filters["source"],
                                         result=filters["result"], before=before, limit=PAGE_SIZE)
    return page("webhooks.html", {
        **await context(request, session, "webhooks"), "receipts": rows, "filters": filters,
        "counts": await operator_reads.receipt_counts(runtime.engine),
        "sources": sorted(runtime.policies.webhooks), "results": RECEIPT_RESULTS,
        "next_before": rows[-1]["id"] if len(rows) == PAGE_SIZE else None})


@router.get("/audit")
async def audit_list(request: Request) -> Response:
    session = await signed_in(request)
    before = Params(request, ("before",)).number("before")
    rows = await operator_reads.actions(runtime_of(request).engine, before=before,
                                        limit=PAGE_SIZE)
    return page("audit.html", {
        **await context(request, session, "audit"), "actions": rows,
        "next_before": rows[-1]["id"] if len(rows) == PAGE_SIZE else None})


IDS_PER_PAGE: Final = 500


@router.get("/audit/{action_id}")
async def audit_action(request: Request, action_id: str) -> Response:
    """One action of the audit trail in full: a bulk change's item ids, a page at a time."""
    session = await signed_in(request)
    page_no = Params(request, ("page",)).number("page") or 1
    found = await operator_reads.action(runtime_of(request).engine,
                                        path_id(action_id, "action"))
    if found is None:
        raise ConsoleError(404, "No such action", f"the audit trail has no action {action_id}")
    ids = found["details"].get("item_ids") or []
    pages = max(1, math.ceil(len(ids) / IDS_PER_PAGE))
    page_no = min(page_no, pages)
    return page("audit_action.html", {
        **await context(request, session, "audit"), "a": found,
        "ids": ids[(page_no - 1) * IDS_PER_PAGE:page_no * IDS_PER_PAGE],
        "page_no": page_no, "pages": pages})

