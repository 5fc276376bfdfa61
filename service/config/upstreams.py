"""An upstream as the policies file declares it, resolved: its header values read from the
environment, its `{credential}` header templates, its base_url compiled (service/config/
origins.py), its proxy and its TLS settings checked.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from service.config.origins import Origin, compile_origin
from service.config.placeholders import TemplateProblems, parse_format
from service.config.policy_file import UpstreamConfig
from service.config.resolution import Resolution
from service.config.tenants import host_form
from service.protocols.egress import (
    Proxy,
    ProxyChoice,
    TlsProblem,
    environment_proxy,
    fixed_proxy,
    no_proxy,
    tls_context,
)


@dataclass(frozen=True)
class Upstream:
    """A resolved upstream: its config plus header values read from the environment, and
    its base_url compiled."""

    name: str
    config: UpstreamConfig
    headers: Mapping[str, str] = field(repr=False)
    origin: Origin = field(repr=False, compare=False)
    # header -> (text before, text after) the tenant's {credential}
    credential_headers: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # its TLS settings (ca_file, a client certificate); None: the public roots
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)

    @property
    def public_only(self) -> bool:
        """Whether its connections may reach only public addresses: a host built from the
        item's ids, without allow_private_addresses (service/protocols/egress.py)."""
        return self.origin.host is None and not self.config.allow_private_addresses

    @property
    def proxy(self) -> ProxyChoice:
        """How its connections leave: its `proxy`, or the environment's."""
        chosen = self.config.proxy
        return (environment_proxy if chosen is None else no_proxy if chosen == "none"
                else fixed_proxy(chosen))

    @property
    def per_tenant_credentials(self) -> bool:
        return self.config.credentials is not None

    @property
    def allow_private_addresses(self) -> bool:
        """Whether a templated host may be an IP literal or a single-label name, and may
        resolve to a loopback, private, link-local or metadata address (the transport
        checks the addresses it connects to; service/config/origins.py the host's
        form)."""
        return self.config.allow_private_addresses

    def tenant(self, tenant_id: str) -> str:
        """The tenant id as its credential for this upstream is stored and looked up: its
        canonical host form where the host is built from it (service/config/tenants.py)."""
        return host_form(tenant_id) if self.origin.tenant_in_host else tenant_id


def resolve_upstreams(declared: Mapping[str, UpstreamConfig], r: Resolution
                      ) -> tuple[dict[str, Upstream], set[str]]:
    """Each upstream that could be compiled, and the names of those with problems (noted
    in `r`): kept, so that their policies' own checks still run against them, but never
    resolved."""
    upstreams: dict[str, Upstream] = {}
    troubled: set[str] = set()
    for name, up in declared.items():
        mark = r.mark()
        upstream = resolve_upstream(name, up, r)
        if r.found_since(mark):
            troubled.add(name)
        if upstream is not None:
            upstreams[name] = upstream
    return upstreams, troubled


def resolve_upstream(name: str, up: UpstreamConfig, r: Resolution) -> Upstream | None:
    """The upstream `name` compiled, or None when it cannot be; every problem is noted in
    `r` (one with a base_url that does not compile still has its proxy and TLS checked)."""
    key = f"upstreams.{name}"
    headers = {header: _header_secret(r, var, f"{key}.headers_from_env.{header}")
               for header, var in up.headers_from_env.items()}
    templated = _header_templates(key, up, r)
    headers.update({h: before for h, (before, after) in templated.items() if after is None})
    credential_headers = {h: (before, after) for h, (before, after) in templated.items()
                          if after is not None}
    origin: Origin | None = None
    try:
        origin = compile_origin(name, up.base_url, up.host_pattern,
                                allow_private=up.allow_private_addresses)
    except TemplateProblems as exc:
        r.fail_template(key, exc)
    if up.proxy is not None and up.proxy != "none":
        try:
            Proxy.of(up.proxy)
        except ValueError as exc:
            r.fail(f"{key}.proxy", str(exc))
    try:
        tls = tls_context(up.ca_file, up.client_cert_file, up.client_key_file)
    except TlsProblem as exc:
        r.fail(f"{key}.{exc.key}", str(exc))
        return None
    if origin is None:
        return None
    return Upstream(name=name, config=up, headers=headers, origin=origin,
                    credential_headers=credential_headers, tls=tls)


# Headers a call sets itself: a policies file never names them.
_CALL_HEADERS: Final = frozenset({"host", "content-length", "content-type",
                                  "transfer-encoding", "idempotency-key", "connection"})
# Text an HTTP header value may hold around a credential: visible ASCII, space and tab.
_HEADER_TEXT: Final = re.compile(r"[\x20-\x7e\t]*")


def _header_secret(r: Resolution, var: str, key: str) -> str:
    """A header's value from the environment: one that would make every call unsendable
    is refused here, never quoted."""
    value = r.secret(var, key)
    if not _HEADER_TEXT.fullmatch(value):
        r.fail(key, f"environment variable {var} holds a line break or a character a "
                    "header value cannot carry (visible ASCII, spaces and tabs)")
    return value


def _header_templates(key: str, up: UpstreamConfig, r: Resolution
                      ) -> dict[str, tuple[str, str | None]]:
    """Each of `headers` as (text, None) when it is plain text, or (before, after) around
    its `{credential}`. Problems go to `r`."""
    out: dict[str, tuple[str, str | None]] = {}
    from_env = {h.lower() for h in up.headers_from_env}
    for header, value in up.headers.items():
        at = f"{key}.headers.{header}"
        try:
            literals, names = _header_pieces(header, value, from_env)
        except ValueError as exc:
            r.fail(at, str(exc))
            continue
        if len(names) > 1:
            r.fail(at, "{credential} may appear once")
        elif names and up.credentials is None:
            r.fail(at, "{credential} needs the upstream's credentials (a directory or the API)")
        elif names:
            out[header] = (literals[0], "".join(literals[1:]))
        else:
            out[header] = ("".join(literals), None)
    _credentials_problems(key, up, out, r)
    return out


def _header_pieces(header: str, value: str, from_env: set[str]
                   ) -> tuple[list[str], list[str]]:
    """A header value's literal texts and its placeholders (only `credential`); ValueError
    saying why the header cannot be sent as written."""
    if header.lower() in _CALL_HEADERS:
        raise ValueError("is set by each call itself")
    if header.lower() in from_env:
        raise ValueError("is also in headers_from_env: name a header once")
    pieces = parse_format(value)
    names = [name for _, name in pieces if name is not None]
    if set(names) - {"credential"}:
        raise ValueError("the one placeholder a header takes is {credential}")
    literals = [text for text, _ in pieces]
    if not all(_HEADER_TEXT.fullmatch(text) for text in literals):
        raise ValueError("a header value is visible ASCII, spaces and tabs")
    return literals, names


def _credentials_problems(key: str, up: UpstreamConfig,
                          templates: Mapping[str, tuple[str, str | None]],
                          r: Resolution) -> None:
    """Per-tenant credentials need a header that sends them, and a directory that is one."""
    if up.credentials is not None and not any(after is not None
                                              for _, after in templates.values()):
        r.fail(f"{key}.credentials", "no header uses {credential}: add one, e.g. headers = "
                                     "{ Authorization = \"Bearer {credential}\" }")
    directory = up.credentials.directory if up.credentials is not None else None
    if directory is not None and not directory.is_dir():
        r.fail(f"{key}.credentials.directory", f"{directory} is not a directory")
