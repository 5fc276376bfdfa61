"""How a connection to an upstream leaves this process: straight to an address that was
checked, or through an HTTP proxy (`CONNECT` for https, absolute-form requests for http).

- Proxies: an upstream's `proxy` (a URL, or "none"), else HTTPS_PROXY / HTTP_PROXY /
  NO_PROXY (and their lower-case spellings) as curl and httpx read them, through the
  standard library's `urllib.request.getproxies` and `proxy_bypass`. Proxy
  credentials come from the proxy URL's user info (Basic).
- Addresses: an upstream whose host is built from tenant ids reaches only global addresses
  unless it opts in (`allow_private_addresses`): every address the host resolves to is
  checked (loopback, private, link-local and so cloud metadata, multicast, unspecified,
  reserved, and IPv4 mapped into IPv6 as what it maps), and the connection goes to an address
  that passed, so a second resolution cannot swap it. Through a proxy the proxy resolves the
  name: the check is made on this process's own resolution first, which a proxy with a
  different view of DNS can differ from.

Every failure here happens before the request is written: httpx.ConnectError (not sent), or
AddressRefused for a host that resolves to an address it may not reach.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import ipaddress
import os
import socket
import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

# Past this many bytes, a proxy's answer to CONNECT is refused (no proxy writes more).
MAX_TUNNEL_ANSWER_BYTES: Final = 16_384


class AddressRefused(httpx.ConnectError):
    """The host resolves to an address its upstream may not reach (never connected)."""


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy: where it listens, and the Proxy-Authorization it takes, if any."""

    host: str
    port: int
    authorization: bytes | None = field(default=None, repr=False)

    @classmethod
    def of(cls, url: str) -> Proxy:
        """A proxy from its URL (http:// only: the hop to the proxy is not encrypted, the
        tunnel through it is); ValueError otherwise."""
        parsed = httpx.URL(url)
        if parsed.scheme != "http" or not parsed.host:
            raise ValueError("a proxy is an http:// URL with a host (the tunnel through it "
                             "carries TLS for https upstreams)")
        auth = None
        if parsed.username or parsed.password:
            pair = f"{parsed.username}:{parsed.password}".encode()
            auth = b"Basic " + base64.b64encode(pair)
        return cls(parsed.host, parsed.port or 80, auth)


ProxyChoice = Callable[[str, str], Proxy | None]  # (scheme, host) -> the proxy, or None


def no_proxy(scheme: str, host: str) -> Proxy | None:
    """Straight to the upstream (an upstream's `proxy = "none"`)."""
    return None


def fixed_proxy(url: str) -> ProxyChoice:
    """Every connection through the proxy at `url` (an upstream's `proxy = "http://..."`)."""
    proxy = Proxy.of(url)
    return lambda scheme, host: proxy


def environment_proxy(scheme: str, host: str) -> Proxy | None:
    """The proxy HTTPS_PROXY or HTTP_PROXY names for `scheme`, unless NO_PROXY covers `host`
    (the transport asks once per host, when it first reaches it)."""
    proxies = urllib.request.getproxies()
    url = proxies.get(scheme)
    if not url or urllib.request.proxy_bypass(host):
        return None
    return Proxy.of(url)


class TlsProblem(ValueError):
    """A TLS file that cannot be read or used; `key` names its setting."""

    def __init__(self, key: str, exc: Exception) -> None:
        super().__init__(f"cannot be used: {type(exc).__name__}: {exc}")
        self.key = key


def public_roots() -> ssl.SSLContext:
    """httpx's default context (certifi's roots, or those SSL_CERT_FILE or SSL_CERT_DIR
    name), built once for each of their values: reading the roots costs milliseconds of CPU,
    and a context is safe to share."""
    return _roots(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _roots(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    del cert_file, cert_dir  # the cache's key: httpx reads them from the environment
    return httpx.create_ssl_context()


def tls_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None
                ) -> ssl.SSLContext | None:
    """The TLS context of an upstream with its own CA bundle or client certificate (None:
    the transport's default, the public roots or SSL_CERT_FILE); TlsProblem for a file that
    cannot be read or used."""
    if ca_file is None and cert_file is None:
        return None
    try:
        context = (ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None
                   else httpx.create_ssl_context())
    except (OSError, ssl.SSLError) as exc:
        raise TlsProblem("ca_file", exc) from None
    if cert_file is not None:
        try:
            context.load_cert_chain(str(cert_file), None if key_file is None else str(key_file))
        except (OSError, ssl.SSLError) as exc:
            raise TlsProblem("client_cert_file", exc) from None
    return context


def refused_address(address: str) -> bool:
    """Whether an upstream built from tenant ids may not reach `address`."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id is no part of it
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (not ip.is_global or ip.is_multicast or ip.is_private or ip.is_loopback
            or ip.is_link_local or ip.is_unspecified or ip.is_reserved)


async def checked_addresses(host: str, port: int) -> list[str]:
    """`host`'s addresses, all of them allowed; AddressRefused naming the host and the first
    refused address, or ConnectError when it does not resolve."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise httpx.ConnectError(type(exc).__name__) from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for address in addresses:
        if refused_address(address):
            raise AddressRefused(f"{host} resolves to {address}, which is not a public "
                                 "address (allow_private_addresses opts in)")
    return addresses


class _TunnelAnswer(asyncio.Protocol):
    """Reads a proxy's answer to CONNECT: its status, once its head has arrived."""

    def __init__(self) -> None:
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._data = b""

    def data_received(self, data: bytes) -> None:
        if self.done.done():  # the tunnel's far end spoke before the TLS handshake
            return
        self._data += data
        head, found, rest = self._data.partition(b"\r\n\r\n")
        if found:
            status = head.split(b" ", 2)[1] if head.count(b" ") >= 1 else b""
            if rest or not status.isdigit():
                self.done.set_exception(httpx.ConnectError("the proxy's answer to CONNECT is "
                                                           "not HTTP, or more than it"))
            else:
                self.done.set_result(int(status))
        elif len(self._data) > MAX_TUNNEL_ANSWER_BYTES:
            self.done.set_exception(httpx.ConnectError("the proxy's answer to CONNECT is too "
                                                       "long"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(httpx.ConnectError("the proxy closed during CONNECT"))


async def open_connection(protocol: Callable[[], asyncio.Protocol], scheme: str, host: str,
                          port: int, *, tls: ssl.SSLContext | None, proxy: Proxy | None,
                          public_only: bool) -> asyncio.Protocol:
    """A connected `protocol()` for `host:port`, directly or through `proxy` (for https a
    CONNECT tunnel carrying TLS to the upstream itself). OSError, asyncio's and ssl's
    errors pass through for the caller to map; AddressRefused as above."""
    loop = asyncio.get_running_loop()
    addresses = await checked_addresses(host, port) if public_only else None
    if proxy is None:
        error: OSError | None = None
        for address in addresses or [host]:
            try:
                _, made = await loop.create_connection(
                    protocol, address, port, ssl=tls, server_hostname=host if tls else None)
                return made
            except OSError as exc:  # the next address, as create_connection does for names
                error = exc
        assert error is not None
        raise error
    if scheme == "http":  # the proxy takes the request itself, in absolute form
        _, made = await loop.create_connection(protocol, proxy.host, proxy.port)
        return made
    raw, answer = await loop.create_connection(_TunnelAnswer, proxy.host, proxy.port)
    try:
        target = f"{host}:{port}".encode("ascii")
        head = b"CONNECT " + target + b" HTTP/1.1\r\nHost: " + target + b"\r\n"
        if proxy.authorization is not None:
            head += b"Proxy-Authorization: " + proxy.authorization + b"\r\n"
        raw.write(head + b"\r\n")
        status = await answer.done
        if not 200 <= status < 300:
            raise httpx.ConnectError(f"the proxy refused the tunnel ({status})")
        made = protocol()
        assert tls is not None
        secured = await loop.start_tls(raw, made, tls, server_hostname=host)
        if secured is None:
            raise httpx.ConnectError("the tunnel closed during the TLS handshake")
        made.connection_made(secured)  # start_tls hands the protocol over without telling it
        return made
    except BaseException:
        raw.close()
        raise
