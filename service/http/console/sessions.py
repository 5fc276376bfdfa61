"""Console sessions: an operator signs in with one of the API's bearer tokens and gets a
session cookie; every state-changing form carries a CSRF token bound to that session.

The cookie is `<secret>.<mac>`: 32 random bytes and an HMAC of them under the key every
replica shares (`console_key`, made by migration 0016). A cookie whose MAC does not verify
is refused without touching the database, so an unauthenticated caller costs an HMAC. A
verified one is looked up by the SHA-256 of its secret (the secret itself is never stored):
the session must exist, be neither expired nor signed out, and its token must still be
configured (removing a token from its setting ends its sessions). A session stores its
token's id, never the token; its role is the token's role now, read from the configuration
on every request (a token moved to a lower role takes its sessions with it).

The CSRF token is an HMAC of the session's secret under the same key: nothing to store, and
one session's token is useless in another. Before sign-in the form carries a token bound
to a short-lived pre-session cookie instead (login CSRF)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Final

from sqlalchemy.ext.asyncio import AsyncEngine

from service.config.tokens import Role, TokenSet
from service.db.statements import Statement, fetch, fetch_none

COOKIE: Final = "sweeper_console"
LOGIN_COOKIE: Final = "sweeper_console_login"
SECRET_BYTES: Final = 32
_MAC_BYTES: Final = 16
# what a cookie value can be at most: both parts in unpadded base64url and the dot
MAX_COOKIE_CHARS: Final = 2 + 4 * (SECRET_BYTES + _MAC_BYTES) // 3 + 2

_KEY = Statement("sessions.key", "The key console cookies and CSRF tokens are signed with.",
                 "SELECT key FROM console_key")
_START = Statement("sessions.start", "A new console session for one operator.", """
    INSERT INTO console_sessions (id, actor, expires_at)
    VALUES (:id, :actor, now() + make_interval(secs => :seconds))
    RETURNING expires_at
""")
_LOOKUP = Statement("sessions.lookup", (
    "A console session's operator, if it is neither expired nor signed out."), """
    SELECT actor, expires_at FROM console_sessions
    WHERE id = :id AND ended_at IS NULL AND expires_at > now()
""")
_END = Statement("sessions.end", "Sign a console session out.",
                 "UPDATE console_sessions SET ended_at = now() "
                 "WHERE id = :id AND ended_at IS NULL")
_PRUNE = Statement("sessions.prune", (
    "Forget sessions that expired or were signed out a day ago or more."),
    "DELETE FROM console_sessions WHERE expires_at < now() - interval '1 day' "
    "OR ended_at < now() - interval '1 day'")


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Session:
    """A signed-in operator: the session's secret (its CSRF tokens derive from it), its
    token's id and that token's role."""

    secret: bytes
    actor: str
    role: Role


class Sessions:
    """Sign-in, look-up and sign-out of console sessions for one process."""

    def __init__(self, engine: AsyncEngine, tokens: TokenSet, *, lifetime_s: int) -> None:
        self.engine = engine
        self.tokens = tokens
        self.lifetime_s = lifetime_s
        self._key: bytes | None = None
        self._lock = asyncio.Lock()

    async def key(self) -> bytes:
        """The shared signing key, read once per process."""
        if self._key is None:
            async with self._lock:
                if self._key is None:
                    self._key = bytes((await fetch(self.engine, _KEY, {}))[0].key)
        return self._key

    def _mac(self, key: bytes, purpose: bytes, secret: bytes) -> bytes:
        return hmac.new(key, purpose + secret, hashlib.sha256).digest()[:_MAC_BYTES]

    async def sign_in(self, token: str) -> tuple[str, Session] | None:
        """A new session's cookie value for a valid API token, else None."""
        caller = self.tokens.match(token)
        if caller is None:
            return None
        key = await self.key()
        secret = secrets.token_bytes(SECRET_BYTES)
        await fetch(self.engine, _START, {"id": hashlib.sha256(secret).hexdigest(),
                                          "actor": caller.id, "seconds": self.lifetime_s})
        await fetch_none(self.engine, _PRUNE, {})
        return (f"{_b64(secret)}.{_b64(self._mac(key, b'cookie', secret))}",
                Session(secret, caller.id, caller.role))

    async def session(self, cookie: str | None) -> Session | None:
        """The live session a cookie names, else None (a bad MAC costs no database read)."""
        secret = await self._verified(cookie, b"cookie")
        if secret is None:
            return None
        rows = await fetch(self.engine, _LOOKUP, {"id": hashlib.sha256(secret).hexdigest()})
        caller = self.tokens.by_id(rows[0].actor) if rows else None
        if caller is None:
            return None
        return Session(secret, caller.id, caller.role)

    async def sign_out(self, session: Session) -> None:
        await fetch_none(self.engine, _END, {"id": hashlib.sha256(session.secret).hexdigest()})

    async def csrf(self, session: Session) -> str:
        """The CSRF token every form of this session carries."""
        return _b64(self._mac(await self.key(), b"csrf", session.secret))

    async def csrf_ok(self, session: Session, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode("ascii", "replace"), (await self.csrf(session)).encode("ascii"))

    # -- before sign-in: a pre-session cookie and the form's token bound to it ---------------

    async def login_cookie(self) -> tuple[str, str]:
        """A fresh pre-session cookie value and the sign-in form's token for it."""
        key = await self.key()
        secret = secrets.token_bytes(SECRET_BYTES)
        return (f"{_b64(secret)}.{_b64(self._mac(key, b'login', secret))}",
                _b64(self._mac(key, b'login-form', secret)))

    async def login_form_ok(self, cookie: str | None, presented: str | None) -> bool:
        secret = await self._verified(cookie, b"login")
        if secret is None or presented is None:
            return False
        expected = _b64(self._mac(await self.key(), b"login-form", secret))
        return hmac.compare_digest(presented.encode("ascii", "replace"),
                                   expected.encode("ascii"))

    async def _verified(self, cookie: str | None, purpose: bytes) -> bytes | None:
        """The secret of a well-formed cookie whose MAC verifies for `purpose`."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        secret_text, mac_text = cookie.split(".")
        secret, mac = _unb64(secret_text), _unb64(mac_text)
        if secret is None or mac is None or len(secret) != SECRET_BYTES:
            return None
        if not hmac.compare_digest(mac, self._mac(await self.key(), purpose, secret)):
            return None
        return secret
