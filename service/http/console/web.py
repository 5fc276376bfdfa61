"""The console's request plumbing: its route class (security headers and error pages on
every answer), who is signed in, the CSRF check on every state-changing form, and bounded
reading of query strings and form bodies.

A query parameter or form field a page does not take is refused (422), like the API's;
every value is bounded before it reaches a statement."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from service.config.tokens import Role
from service.history.minutes import WINDOWS
from service.http.api import access
from service.http.api.bodies import MAX_BIGINT
from service.http.api.gate import BodyRefused, read_body
from service.http.api.reasons import reason_problem
from service.http.console.overview import OverviewCache, SharedReadings
from service.http.console.render import ConsoleError, error_page, secure
from service.http.console.sessions import COOKIE, Session, Sessions
from service.runtime import Runtime

PREFIX: Final = "/console"
MAX_FORM_BYTES: Final = 256 * 1024  # a bulk form of 1,000 selected ids fits easily
MAX_FORM_FIELDS: Final = 2_000
MAX_TEXT: Final = 1_000  # an id or a filter (reasons follow service/http/api/reasons.py)
FORM_TIMEOUT_S: Final = 10.0
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class ConsoleState:
    """What the console keeps per process: its sessions, the shared overview and charts."""

    sessions: Sessions
    overview: OverviewCache
    charts: SharedReadings


class SignInRequired(Exception):
    """No live session: a page sends the browser to sign in, a form is refused."""


def runtime_of(request: Request) -> Runtime:
    runtime: Runtime = request.state.runtime
    return runtime


def console_of(request: Request) -> ConsoleState:
    console: ConsoleState = request.state.console
    return console


_SESSION: Final = "console_session"  # request.state: the session signed_in found


async def signed_in(request: Request) -> Session:
    """The request's live session, or SignInRequired (looked up once per request); a 403
    page when its token's role is below what the route needs (service/http/api/access.py),
    before any form is read."""
    session = await console_of(request).sessions.session(request.cookies.get(COOKIE))
    if session is None:
        raise SignInRequired
    setattr(request.state, _SESSION, session)
    need = access.needed(request.method, request.scope["route"].path)
    if isinstance(need, Role) and session.role < need:
        raise role_too_low(need, session)
    return session


def role_too_low(need: Role, session: Session, what: str = "this page") -> ConsoleError:
    """The 403 page for a session whose token's role is below `need`."""
    return ConsoleError(403, "Not allowed", f"{what} needs the {need.label} role; this "
                                            f"session's token has the {session.role.label} "
                                            "role")


async def context(request: Request, session: Session | None, nav: str) -> dict[str, Any]:
    """What every page's layout needs, with what the session's role may change (the pages
    show only the forms it can use)."""
    csrf = await console_of(request).sessions.csrf(session) if session is not None else ""
    role = session.role if session is not None else None
    return {"operator": session.actor if session else None,
            "role": role.label if role is not None else None, "csrf": csrf, "nav": nav,
            "now_ts": time.time(),
            "may_operate": role is not None and role >= Role.OPERATOR,
            "may_lift_closure": role is not None and role >= access.LIFT_CLOSURE}


class ConsoleRoute(APIRoute):
    """Every console answer gets the security headers; SignInRequired and ConsoleError
    become a redirect to sign in and an error page."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                response = await handler(request)
            except SignInRequired:
                if request.method in ("GET", "HEAD"):
                    return secure(RedirectResponse(f"{PREFIX}/sign-in", status_code=303))
                response = error_page(ConsoleError(
                    403, "Sign in first", "this session has ended; sign in and try again"),
                    await context(request, None, ""))
            except ConsoleError as error:  # the layout of whoever signed_in found, if any
                response = error_page(error, await context(
                    request, getattr(request.state, _SESSION, None), ""))
            return secure(response)

        return answer


DEFAULT_WINDOW: Final = "hour"


def window_of(params: Params) -> str:
    """A chart page's `window` parameter: hour, day or week (hour when absent)."""
    return params.choice("window", WINDOWS) or DEFAULT_WINDOW


class Params:
    """A page's query parameters, each read at most once, bounded; unknown and repeated
    ones refused, as a form's fields are."""

    def __init__(self, request: Request, allowed: Collection[str]) -> None:
        given = Counter(name for name, _ in request.query_params.multi_items())
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise ConsoleError(422, "Unknown parameter",
                               f"this page takes no parameter {unknown[0][:64]!r}")
        repeated = sorted(name for name, n in given.items() if n > 1)
        if repeated:
            raise ConsoleError(422, "Repeated parameter",
                               f"{repeated[0][:64]} was sent more than once")
        self.values: Mapping[str, str] = request.query_params

    def string(self, name: str, max_chars: int = MAX_TEXT) -> str | None:
        return checked_text(name, self.values.get(name), max_chars)

    def number(self, name: str, low: int = 1, high: int = MAX_BIGINT) -> int | None:
        return checked_number(name, self.values.get(name), low, high)

    def choice(self, name: str, choices: Collection[str]) -> str | None:
        return checked_choice(name, self.values.get(name), choices)


def checked_text(name: str, value: str | None, max_chars: int = MAX_TEXT) -> str | None:
    """A text value, None when empty; refused when too long or holding control characters
    (an id or reason the ledger cannot hold either)."""
    if value is None or value == "":
        return None
    if len(value) > max_chars:
        raise ConsoleError(422, "Value too long", f"{name} may be at most {max_chars} "
                                                  "characters")
    if _CONTROL.search(value) or any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        raise ConsoleError(422, "Invalid value", f"{name} holds a control character")
    return value


def whole_number(value: str) -> int | None:
    """A value of ASCII digits that fits a bigint, else None (never thousands of digits
    converted)."""
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        return None
    return int(value)


def checked_number(name: str, value: str | None, low: int, high: int) -> int | None:
    if value is None or value == "":
        return None
    number = whole_number(value)
    if number is None:
        raise ConsoleError(422, "Invalid number", f"{name} must be a whole number")
    if not low <= number <= high:
        raise ConsoleError(422, "Number out of range",
                           f"{name} must be between {low} and {high}")
    return number


def checked_choice(name: str, value: str | None, choices: Collection[str]) -> str | None:
    if value is None or value == "":
        return None
    if value not in choices:
        raise ConsoleError(422, "Invalid choice", f"{name} must be one of "
                                                  f"{', '.join(sorted(choices))}")
    return value


class Form:
    """A posted form's fields (x-www-form-urlencoded, bounded); unknown ones refused."""

    def __init__(self, pairs: list[tuple[str, str]], allowed: Collection[str]) -> None:
        names = {name for name, _ in pairs}
        unknown = sorted(names - set(allowed) - {"csrf"})
        if unknown:
            raise ConsoleError(422, "Unknown field",
                               f"this form has no field {unknown[0][:64]!r}")
        self.pairs = pairs

    def all(self, name: str) -> list[str]:
        return [value for key, value in self.pairs if key == name]

    def get(self, name: str) -> str | None:
        values = self.all(name)
        if len(values) > 1:
            raise ConsoleError(422, "Repeated field", f"{name} was sent more than once")
        return values[0] if values else None

    def string(self, name: str, max_chars: int = MAX_TEXT) -> str | None:
        return checked_text(name, self.get(name), max_chars)

    def number(self, name: str, low: int = 1, high: int = MAX_BIGINT) -> int | None:
        return checked_number(name, self.get(name), low, high)

    def choice(self, name: str, choices: Collection[str]) -> str | None:
        return checked_choice(name, self.get(name), choices)

    def reason(self, name: str) -> str | None:
        """A free-text reason, None when empty; refused (422 naming the field) as the API
        refuses it (service/http/api/reasons.py)."""
        value = self.get(name)
        if value is None or value == "":
            return None
        problem = reason_problem(value)
        if problem:
            raise ConsoleError(422, "Invalid reason", f"{name} {problem}")
        return value


async def read_form(request: Request, allowed: Collection[str]) -> Form:
    """The request's form fields, refused when not a bounded urlencoded UTF-8 form."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/x-www-form-urlencoded":
        raise ConsoleError(415, "Unsupported form", "send the form as the page does "
                                                    "(application/x-www-form-urlencoded)")
    try:
        body = await read_body(request.scope, request.receive, limit=MAX_FORM_BYTES,
                               timeout_s=FORM_TIMEOUT_S)
        pairs = parse_qsl(body.decode("ascii"), keep_blank_values=True,
                          max_num_fields=MAX_FORM_FIELDS, encoding="utf-8", errors="strict")
    except BodyRefused as exc:
        raise ConsoleError(413 if exc.reason == "too-large" else 400, "Form refused",
                           exc.detail) from None
    except ValueError:  # not ASCII, bad UTF-8 in an escape, or too many fields
        raise ConsoleError(400, "Form refused", "the form could not be read") from None
    return Form(pairs, allowed)


async def checked_form(request: Request, session: Session, allowed: Collection[str]) -> Form:
    """A state-changing form: from this origin (when the browser says), carrying this
    session's CSRF token; else 403, whatever else it holds."""
    origin = request.headers.get("origin")
    if origin is not None and not same_origin(request, origin):
        raise ConsoleError(403, "Cross-site request refused",
                           "this form was not sent from the console's own pages")
    form = await read_form(request, allowed)
    if not await console_of(request).sessions.csrf_ok(session, form.get("csrf")):
        raise ConsoleError(403, "Form expired", "the form's security token does not match "
                                                "this session; reload the page and try again")
    return form


def same_origin(request: Request, origin: str) -> bool:
    """Whether an Origin header names the host this request was sent to."""
    parts = urlsplit(origin)
    host = request.headers.get("host", "")
    return parts.scheme in ("http", "https") and parts.netloc == host and bool(host)
