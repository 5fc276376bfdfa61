"""What the console changes: signing in and out, triggering a run, re-driving and
cancelling items, pausing, resuming and re-budgeting scopes, pausing workers.

Every change is a POST from the console's own pages carrying the session's CSRF token
(service/http/console/web.py), goes through the same domain function as the API's (which
writes the audit row in the change's transaction), and answers by redirecting to a page
that shows the result. A bulk change of items first shows how many items it will touch
and asks for confirmation; its "why" is required."""

from __future__ import annotations

import json
import math
from typing import Final
from urllib.parse import urlencode

from fastapi import APIRouter
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from service.budget import scope_controls
from service.http.api import access
from service.http.api.bodies import MAX_BIGINT
from service.http.api.items import MAX_CHANGE
from service.http.api.scopes import BudgetIn
from service.http.console.pages import (
    ITEM_FILTERS,
    item_filter,
    path_id,
    run_or_404,
    scope_view,
)
from service.http.console.render import ConsoleError, page
from service.http.console.sessions import COOKIE, LOGIN_COOKIE, Session
from service.http.console.web import (
    PREFIX,
    ConsoleRoute,
    checked_form,
    console_of,
    context,
    read_form,
    role_too_low,
    runtime_of,
    signed_in,
    whole_number,
)
from service.ledger import item_selection, operator_reads
from service.runs import trigger

router = APIRouter(prefix=PREFIX, route_class=ConsoleRoute, include_in_schema=False)

LOGIN_COOKIE_S: Final = 3_600
MAX_TOKEN_CHARS: Final = 1_000
MAX_SELECTED: Final = 1_000
ACTIONS: Final = {"redrive": ("dead", "Re-drive", "back to pending, attempts reset"),
                  "cancel": ("pending", "Cancel", "withdrawn before they run")}


def _actor(session: Session) -> str:
    """Who the audit trail names for a console change: the token's operator, via the
    console."""
    return f"{session.actor} (console)"


def _see_other(path: str) -> RedirectResponse:
    return RedirectResponse(PREFIX + path, status_code=303)


def _cookie(request: Request, response: Response, name: str, value: str, max_age: int,
            path: str) -> None:
    secure = (request.url.scheme == "https"
              or runtime_of(request).settings.console_secure_cookies)
    response.set_cookie(name, value, max_age=max_age, path=path, httponly=True,
                        samesite="strict", secure=secure)


@router.get("/sign-in")
async def sign_in_page(request: Request) -> Response:
    sessions = console_of(request).sessions
    if await sessions.session(request.cookies.get(COOKIE)) is not None:
        return _see_other("")
    return await _sign_in_form(request, None, 200)


async def _sign_in_form(request: Request, problem: str | None, status: int) -> Response:
    cookie, token = await console_of(request).sessions.login_cookie()
    response = page("sign_in.html", {**await context(request, None, ""), "login_csrf": token,
                                     "problem": problem}, status=status)
    _cookie(request, response, LOGIN_COOKIE, cookie, LOGIN_COOKIE_S, f"{PREFIX}/sign-in")
    return response


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    sessions = console_of(request).sessions
    form = await read_form(request, ("token",))
    if not await sessions.login_form_ok(request.cookies.get(LOGIN_COOKIE), form.get("csrf")):
        return await _sign_in_form(request, "The sign-in form expired; try again.", 403)
    token = form.get("token") or ""
    started = await sessions.sign_in(token) if len(token) <= MAX_TOKEN_CHARS else None
    if started is None:
        return await _sign_in_form(request, "That token is not valid.", 401)
    cookie, _session = started
    response = _see_other("")
    _cookie(request, response, COOKIE, cookie, sessions.lifetime_s, PREFIX)
    response.delete_cookie(LOGIN_COOKIE, path=f"{PREFIX}/sign-in")
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    session = await signed_in(request)
    await checked_form(request, session, ())
    await console_of(request).sessions.sign_out(session)
    response = _see_other("/sign-in")
    response.delete_cookie(COOKIE, path=PREFIX)
    return response


@router.post("/runs")
async def trigger_run(request: Request) -> Response:
    """A report-only run: the console starts no deleting run but from a report's figures
    (`delete_reported`)."""
    session = await signed_in(request)
    runtime = runtime_of(request)
    form = await checked_form(request, session, ("policy",))
    policy = form.choice("policy", runtime.policies.policies)
    run_id, _created = await trigger.create_run(
        runtime.engine, trigger.RunRequest(policy, None, None, True, None), None,
        actor=_actor(session))
    runtime.wake_publisher()
    return _see_other(f"/runs/{run_id}")


@router.post("/runs/{run_id}/delete")
async def delete_reported(request: Request, run_id: str) -> Response:
    """The deleting run of a published report-only run's selection (its policy, tenant and
    cutoff), capped at the candidates it reported and the operator typed back, with a
    reason; once per report (its trigger key), in the audit trail with both run ids."""
    session = await signed_in(request)
    runtime = runtime_of(request)
    form = await checked_form(request, session, ("why", "confirm"))
    report = await run_or_404(request, path_id(run_id, "run"))
    if not report["dry_run"] or report["state"] != "published":
        raise ConsoleError(409, "Not a finished report", "a deleting run starts from a "
                                                         "published report-only run")
    candidates = int(report["candidates"])
    why = _required(form.reason("why"), "the run")
    if candidates == 0 or form.get("confirm") != str(candidates):
        raise ConsoleError(422, "Type the count to confirm",
                           f"type {candidates} (the candidates this report found) to start "
                           "a run deleting at most that many items")
    deleting, _created = await trigger.create_run(
        runtime.engine, trigger.RunRequest(
            report["policy"], report["tenant_id"], report["cutoff"],
            False, candidates),
        f"console:delete-reported:{report['id']}", actor=_actor(session), reason=why,
        details={"report_run_id": report["id"]})
    runtime.wake_publisher()
    return _see_other(f"/runs/{deleting}")


def _required(why: str | None, what: str) -> str:
    """A change's reason, which the console requires (the API does not)."""
    if why is None or not why.strip():
        raise ConsoleError(422, "Say why", "a reason is required: it is kept in the audit "
                                           f"trail with {what}")
    return why


@router.post("/items/action")
async def item_action(request: Request) -> Response:
    """Preview, then on confirmation apply, a re-drive or cancellation of the selected
    items or of every item the filter matches."""
    session = await signed_in(request)
    runtime = runtime_of(request)
    form = await checked_form(request, session, (
        "action", "target", "id", "why", "step", *ITEM_FILTERS))
    action = form.choice("action", ACTIONS)
    target = form.choice("target", ("selected", "filter"))
    if action is None or target is None:
        raise ConsoleError(422, "Choose an action", "choose re-drive or cancel, and whether "
                                                    "it applies to the selected items or to "
                                                    "every item the filter matches")
    status, verb, effect = ACTIONS[action]
    shown, chosen = item_filter(form, runtime.policies)
    ids = [_item_id(value) for value in form.all("id")[:MAX_SELECTED + 1]]
    if target == "selected":
        if not ids:
            raise ConsoleError(422, "Nothing selected", "tick the items to change, or apply "
                                                        "the action to the filter")
        if len(ids) > MAX_SELECTED:
            raise ConsoleError(422, "Too many selected",
                               f"select at most {MAX_SELECTED} items at once")
        chosen = item_selection.ItemFilter(ids=ids)
    why = form.reason("why")
    fields = {"action": action, "target": target, "why": why or "", **{
        k: v or "" for k, v in shown.items()}}
    why = _required(why, "the change")
    if form.get("step") != "confirm":
        count = await operator_reads.selection_size(runtime.engine, status, chosen, cap=MAX_CHANGE)
        return page("confirm.html", {
            **await context(request, session, "items"), "verb": verb, "effect": effect,
            "status": status, "count": count, "cap": MAX_CHANGE, "fields": fields,
            "ids": ids if target == "selected" else []})
    change = item_selection.redrive if action == "redrive" else item_selection.cancel
    changed = await change(runtime.engine, chosen, actor=_actor(session), reason=why,
                           limit=MAX_CHANGE)
    if changed and action == "redrive":
        runtime.run_progress.forget()  # their runs have pending items again
    return page("done.html", {**await context(request, session, "items"), "verb": verb,
                              "effect": effect, "count": len(changed),
                              "item_ids": changed[:100]})


def _item_id(value: str) -> int:
    number = whole_number(value)
    if number is None or not 1 <= number <= MAX_BIGINT:
        raise ConsoleError(422, "Invalid selection", "item ids are whole numbers from 1")
    return number


def _scope_name(form_name: str | None) -> str:
    if form_name is None:
        raise ConsoleError(422, "No scope named", "the form names no scope")
    return form_name


@router.post("/scope/pause")
async def pause_scope(request: Request) -> Response:
    session = await signed_in(request)
    form = await checked_form(request, session, ("name", "reason"))
    name = _scope_name(form.string("name"))
    if not await scope_controls.pause(runtime_of(request).engine, name, actor=_actor(session),
                                      reason=form.reason("reason")):
        raise ConsoleError(404, "No such scope", "there is no scope by that name")
    return _see_other("/scope?" + _name_query(name))


@router.post("/scope/resume")
async def resume_scope(request: Request) -> Response:
    session = await signed_in(request)
    form = await checked_form(request, session, ("name", "reason", "lift_closure"))
    name = _scope_name(form.string("name"))
    lift_closure = form.choice("lift_closure", ("on",)) == "on"
    if lift_closure and session.role < access.LIFT_CLOSURE:
        raise role_too_low(access.LIFT_CLOSURE, session, "lifting the upstream's closure")
    if not await scope_controls.resume(runtime_of(request).engine, name, actor=_actor(session),
                                       reason=form.reason("reason"), lift_closure=lift_closure):
        raise ConsoleError(404, "No such scope", "there is no scope by that name")
    return _see_other("/scope?" + _name_query(name))


@router.post("/scope/budget")
async def scope_budget(request: Request) -> Response:
    """A new rate, burst and weight, validated by the API's own body model."""
    session = await signed_in(request)
    form = await checked_form(request, session,
                              ("name", "rate_per_second", "burst", "weight", "reason"))
    name = _scope_name(form.string("name"))
    given = {key: form.string(key, 40) for key in ("rate_per_second", "burst", "weight")}
    errors: list[str] = []
    body: dict[str, object] = {"reason": form.reason("reason")}
    for key, kind in (("rate_per_second", float), ("burst", int), ("weight", int)):
        value = given[key]
        if value is None:
            if key != "weight":
                errors.append(f"{key}: required")
            continue
        try:
            number = kind(value)
        except ValueError:
            errors.append(f"{key}: must be {'a number' if kind is float else 'a whole number'}")
            continue
        if isinstance(number, float) and not math.isfinite(number):
            errors.append(f"{key}: must be a finite number")
            continue
        body[key] = number
    if not errors:
        try:
            budget = BudgetIn.model_validate_json(json.dumps(body))
        except ValidationError as exc:
            errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
    if errors:
        return await scope_view(request, session, name, dict(given), 422, errors)
    if not await scope_controls.set_budget(runtime_of(request).engine, name,
                                           rate=budget.rate_per_second, burst=budget.burst,
                                           weight=budget.weight, actor=_actor(session),
                                           reason=budget.reason):
        raise ConsoleError(404, "No such scope", "there is no scope by that name")
    return _see_other("/scope?" + _name_query(name))


def _name_query(name: str) -> str:
    return urlencode({"name": name})


@router.post("/workers/{change}")
async def workers(request: Request, change: str) -> Response:
    session = await signed_in(request)
    if change not in ("pause", "resume"):
        raise ConsoleError(404, "No such page", "workers can be paused or resumed")
    form = await checked_form(request, session, ("reason",))
    await scope_controls.set_workers_paused(runtime_of(request).engine, paused=change == "pause",
                                            actor=_actor(session), reason=form.reason("reason"))
    return _see_other("/scopes")
