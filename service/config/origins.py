"""An upstream's origin: its base_url compiled once (scheme and user info, a fixed host or a
host template guarded by `host_pattern`, the port, the base path's pieces), and the check a
host filled in from an item's ids must pass before any call goes to it.

A templated host is substituted as written; the whole host must then be a host name in its
canonical form (service/config/hosts.py, service/config/tenants.py) that the upstream's
`host_pattern` fully matches; an IP literal or a single-label name (`localhost`,
`metadata`) only where the upstream sets `allow_private_addresses`. So no value can add a
port, a user, a path or another host: `/`, `?`, `#`, `@`, `:`, `%`, whitespace or unicode
make no host name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from service.config.hosts import host_name_problem, host_pattern_problems, internal_host_problem
from service.config.placeholders import (
    FIELDS,
    TemplateProblems,
    parse_format,
    unknown_placeholders,
)
from service.config.tenants import host_form

Pieces = list[tuple[str, str | None]]  # a str.format template parsed: (text, placeholder)


@dataclass(frozen=True)
class Origin:
    """An upstream's base_url, compiled: `prefix` (scheme and user info), the host (fixed, or
    a template guarded by `pattern`), `port` (":8443" or "") and the base path's pieces."""

    upstream: str
    prefix: str
    host: str | None  # the fixed host; None when templated
    host_pieces: Pieces | None
    pattern: re.Pattern[str] | None
    port: str
    path_pieces: Pieces
    # a templated host may be an IP literal or a single-label name (tests, in-cluster)
    allow_private: bool = False

    @property
    def tenant_in_host(self) -> bool:
        """Whether the host is built from the tenant id (which then has one spelling:
        service/config/tenants.py)."""
        return any(name == "tenant_id" for _, name in self.host_pieces or ())

    def base(self, host: str) -> str:
        """scheme://[userinfo@]host[:port], for a client's URL maker."""
        return f"{self.prefix}{host}{self.port}"


_BASE_URL: Final = re.compile(r"(?P<scheme>https?)://(?P<authority>[^/]*)(?P<path>/.*)?",
                              re.DOTALL)
_HOST_LITERAL: Final = re.compile(r"[A-Za-z0-9.-]*", re.ASCII)


def compile_origin(upstream: str, base_url: str, host_pattern: str | None, *,
                   allow_private: bool = False) -> Origin:
    """Compile a base_url (already checked against the schema's pattern, trailing '/'
    stripped); TemplateProblems naming `base_url` or `host_pattern`. Without
    `allow_private`, a templated host can be no IP literal nor single-label name, and a
    pattern that admits one is refused."""
    match = _BASE_URL.fullmatch(base_url)
    if match is None:  # the schema's pattern refused it already
        raise TemplateProblems([("base_url", "must be http(s)://host[:port][/path]")])
    userinfo, at, host, port = _split_authority(match["authority"])
    try:
        pieces = {part: parse_format(text) for part, text in (
            ("user info", userinfo), ("host", host), ("port", port),
            ("path", match["path"] or ""))}
    except ValueError as exc:
        raise TemplateProblems([("base_url", str(exc))]) from None
    templated = any(name is not None for _, name in pieces["host"])
    host_pieces = pieces["host"] if templated else None
    problems = _base_url_problems(pieces, port)
    pattern, pattern_problems = _host_pattern(host_pattern, host_pieces,
                                              allow_private=allow_private)
    problems += pattern_problems
    if problems:
        raise TemplateProblems(problems)
    prefix = f"{match['scheme']}://" + (userinfo + at if at else "")
    return Origin(upstream=upstream, prefix=prefix, host=None if templated else host,
                  host_pieces=host_pieces, pattern=pattern, port=port,
                  path_pieces=pieces["path"], allow_private=allow_private)


def _split_authority(authority: str) -> tuple[str, str, str, str]:
    """A URL's authority as (user info, '@' or '', host, ':port' or '')."""
    userinfo, at, hostport = authority.rpartition("@")
    if hostport.startswith("["):
        host, _, port = hostport.partition("]")
        return userinfo, at, host + "]", port
    host, colon, port = hostport.partition(":")
    return userinfo, at, host, colon + port


def _base_url_problems(pieces: Mapping[str, Pieces], port: str) -> list[tuple[str, str]]:
    """What is wrong with the placeholders of a base_url's parts and with its port."""
    names = {part: {n for _, n in p if n is not None} for part, p in pieces.items()}
    problems: list[tuple[str, str]] = []
    problem = unknown_placeholders(set().union(*names.values()), FIELDS)
    if problem:
        problems.append(("base_url", problem))
    for part in ("user info", "port"):
        if names[part]:
            problems.append(("base_url", f"a placeholder cannot be in the {part}; only in "
                                         "the host and the path"))
    if port and not names["port"] and not re.fullmatch(r":[0-9]{1,5}", port):
        problems.append(("base_url", "the port must be a number"))
    if names["host"] and not all(_HOST_LITERAL.fullmatch(text) for text, _ in pieces["host"]):
        problems.append(("base_url", "in a host with a placeholder, the text around it "
                                     "may only be letters, digits, '-' and '.'"))
    return problems


def _host_pattern(host_pattern: str | None, host_pieces: Pieces | None, *,
                  allow_private: bool) -> tuple[re.Pattern[str] | None, list[tuple[str, str]]]:
    """The compiled host_pattern of a templated host (None for a fixed one), and what is
    wrong with it: missing, present for a fixed host, or letting a value escape the host."""
    if host_pieces is None:
        return None, [] if host_pattern is None else [
            ("host_pattern", "only for a base_url whose host has a placeholder")]
    if host_pattern is None:
        return None, [("host_pattern", "required when the base_url's host has a "
                                       "placeholder: the hosts an item may make, e.g. "
                                       "'[a-z0-9][a-z0-9-]*\\.myshopify\\.com'")]
    try:
        pattern = re.compile(host_pattern)
    except re.error as exc:
        return None, [("host_pattern", f"not a regular expression: {exc}")]
    return pattern, [("host_pattern", p) for p in host_pattern_problems(
        pattern, host_pieces, allow_private=allow_private)]


def checked_host(origin: Origin, made: str) -> str:
    """A templated host as filled in, or ValueError saying why it is refused (without the
    value, but for its canonical form: answers never echo input): no host name, not in its
    canonical form (service/config/tenants.py), an IP literal or single-label name the upstream
    does not allow (allow_private_addresses), or not one its host_pattern allows."""
    assert origin.pattern is not None
    problem = host_name_problem(made)
    if problem:
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is "
                         f"{problem}")
    canonical = host_form(made)
    if made != canonical:
        # a second spelling of a host is a second identity of its tenant (service/config/tenants.py)
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is not in "
                         f"its canonical form {canonical!r} (lower case, no trailing dot)")
    internal = None if origin.allow_private else internal_host_problem(made)
    if internal is not None:
        raise ValueError(f"would make a host of upstream {origin.upstream!r} that is "
                         f"{internal}, which it does not allow (allow_private_addresses)")
    if not origin.pattern.fullmatch(made):
        raise ValueError(f"would make a host that upstream {origin.upstream!r} does not "
                         "allow (its host_pattern)")
    return made
