"""API tokens and the role each carries.

A token's role comes from the setting that lists it: `SWEEPER_API_TOKENS` (admin: every
right, what a token meant before roles existed, so configurations from then keep working),
`SWEEPER_OPERATOR_TOKENS` and `SWEEPER_VIEWER_TOKENS`. The setting is the role's syntax: no
part of a token's text is read as a role, so no token can be mistaken for one.

A token is named by its id, `token:` and the first 8 hex digits of its SHA-256: the audit
trail, the console and the logs name tokens by it, never by the secret. Tokens are held as
digests; `match` compares every one in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

ID_PREFIX: Final = "token:"
ID_HEX_DIGITS: Final = 8


class Role(IntEnum):
    """What a token may do; each role has every right of the ones below it."""

    VIEWER = 1  # reads: every GET, the console's pages
    OPERATOR = 2  # runs, registration, re-drive, cancel, pauses, budgets
    ADMIN = 3  # holds, credentials, lifting an upstream's closure: everything

    @property
    def label(self) -> str:
        """The role's name as configuration and answers spell it."""
        return self.name.lower()


# the setting (without SWEEPER_) that lists each role's tokens
ROLE_SETTINGS: Final = {Role.ADMIN: "api_tokens", Role.OPERATOR: "operator_tokens",
                        Role.VIEWER: "viewer_tokens"}


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def token_id(token: str) -> str:
    """A token's non-secret id: what the audit trail and the console name it by."""
    return ID_PREFIX + _digest(token).hex()[:ID_HEX_DIGITS]


@dataclass(frozen=True)
class Caller:
    """An authenticated token: its id and its role."""

    id: str
    role: Role


@dataclass(frozen=True)
class TokenSet:
    """Bearer tokens accepted on /v1 (several per role, e.g. two during a rotation), held
    as digests with their roles."""

    entries: tuple[tuple[bytes, Role], ...] = field(repr=False)

    @classmethod
    def of(cls, tokens: Iterable[tuple[str, Role]]) -> TokenSet:
        """The set of (token, role) pairs; `token_problems` has checked them."""
        return cls(tuple((_digest(token), role) for token, role in tokens))

    def match(self, presented: str) -> Caller | None:
        """The caller a valid token names, else None. Constant time: every configured token
        is compared, on equal-length digests, whatever matches first."""
        candidate = _digest(presented)
        found = None
        for digest, role in self.entries:
            if hmac.compare_digest(candidate, digest):
                found = Caller(ID_PREFIX + digest.hex()[:ID_HEX_DIGITS], role)
        return found

    def by_id(self, caller_id: str) -> Caller | None:
        """The caller of a still configured token with this id, with its role now (console
        sessions end when their token is removed, and follow a change of its role)."""
        for digest, role in self.entries:
            if caller_id == ID_PREFIX + digest.hex()[:ID_HEX_DIGITS]:
                return Caller(caller_id, role)
        return None


def token_problems(tokens: Iterable[tuple[str, Role]]) -> list[str]:
    """Why a configuration of tokens and roles is ambiguous: a token listed under two roles,
    or two tokens with one id (the audit trail could not tell them apart). Never quotes a
    token."""
    problems = []
    roles: dict[str, set[Role]] = {}
    ids: dict[str, set[str]] = {}
    for token, role in tokens:
        roles.setdefault(token, set()).add(role)
        ids.setdefault(token_id(token), set()).add(token)
    for held in roles.values():
        if len(held) > 1:
            names = " and ".join(f"SWEEPER_{ROLE_SETTINGS[r].upper()}"
                                 for r in sorted(held, reverse=True))
            problems.append(f"a token is listed in both {names}: give each token one role")
    for name, distinct in sorted(ids.items()):
        if len(distinct) > 1:
            problems.append(f"two tokens share the id {name}: replace one of them")
    return problems
