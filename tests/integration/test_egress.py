"""How calls leave (service/protocols/egress.py): through a real HTTP proxy (Debian's tinyproxy,
started here) for http and https upstreams, NO_PROXY honoured; mutual TLS with a private
CA; and a host built from tenant ids that resolves to a private address is never
connected to. All on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from service.config.policies import Policies
from service.errors import ConfigError
from service.outcomes import Answer, Failure
from service.protocols.egress import refused_address
from service.protocols.transport import Http1Transport
from service.upstreams.deletion_api import CallResult, UpstreamClient
from service.upstreams.exchange import send
from tests.conftest import free_port, policies_from
from tests.fakes.upstream import FakeUpstream
from tests.integration.test_wire import NO_CONTENT, Wire, request

KEY = "k" * 64


def policies(base_url: str, **upstream: Any) -> Policies:
    return policies_from({
        "upstreams": {"shop": {"base_url": base_url, "timeout_seconds": 5, **upstream}},
        "policies": {"carts": {"version": 1, "upstream": "shop", "path": "/carts/{object_id}",
                               "scope": "shop", "rate": {"per_second": 100}}}})


async def delete(chosen: Policies, tenant_id: str = "t") -> CallResult:
    client = UpstreamClient(chosen.upstreams["shop"])
    try:
        return await client.delete(chosen.policies["carts"], tenant_id=tenant_id,
                                   object_id="1", operation_key=KEY)
    finally:
        await client.aclose()


# -- addresses -----------------------------------------------------------------------------

@pytest.mark.parametrize(("address", "refused"), [
    ("127.0.0.1", True), ("127.0.0.3", True), ("10.1.2.3", True), ("172.16.0.1", True),
    ("192.168.1.1", True), ("169.254.169.254", True), ("100.64.0.1", True),
    ("0.0.0.0", True),  # noqa: S104 - an address to refuse, not to bind ("224.0.0.1", True), ("255.255.255.255", True), ("::1", True),
    ("fe80::1%eth0", True), ("fd00:ec2::254", True), ("::ffff:127.0.0.1", True),
    ("::ffff:169.254.169.254", True), ("::", True),
    ("8.8.8.8", False), ("1.1.1.1", False), ("2001:4860:4860::8888", False)])
def test_which_addresses_a_tenant_built_host_may_reach(address: str, refused: bool) -> None:
    assert refused_address(address) is refused


@pytest.mark.parametrize("host", ["localhost", "0x7f000003", "127.0.0.3", "2130706433"])
async def test_a_tenant_built_host_never_reaches_a_private_address(host: str) -> None:
    """Behind a host_pattern that lets a name through, what the name resolves to is checked
    before connecting (hex and integer forms resolve as addresses too)."""
    transport = Http1Transport(4, public_only=True)
    async with FakeUpstream() as fake:
        answer = await send(transport, request(f"http://{host}:{fake.port}"), 5.0,
                            lambda status: False, 0)
        assert fake.calls() == [] and fake.connections_accepted() == 0
    await transport.aclose()
    assert answer.failure is Failure.PRIVATE_ADDRESS
    # the refusal names the host (the tenant) and the address; nothing else
    assert re.fullmatch(rf"{re.escape(host)} resolves to 127\.0\.0\.[0-9]+",
                        answer.detail or ""), answer


async def test_the_opt_in_reaches_them() -> None:
    async with FakeUpstream() as fake:
        chosen = policies(f"http://{{tenant_id}}:{fake.port}",
                          host_pattern=r"127\.0\.0\.1|localhost", allow_private_addresses=True)
        assert chosen.upstreams["shop"].public_only is False
        assert (await delete(chosen, "localhost")).answer.status == 204
        # a fixed host is the operator's own choice: never checked
        fixed = policies(fake.base_url)
        assert fixed.upstreams["shop"].public_only is False
        assert (await delete(fixed)).answer.status == 204
    assert policies("https://{tenant_id}", host_pattern=r"[a-z0-9-]+\.myshopify\.com"
                    ).upstreams["shop"].public_only is True


# -- proxies -------------------------------------------------------------------------------

def tinyproxy() -> str:
    found = shutil.which("tinyproxy")
    if found is None:
        if os.environ.get("SWEEPER_REQUIRE_TOOLS"):
            pytest.fail("tinyproxy is not installed (Debian package tinyproxy)")
        pytest.skip("tinyproxy is not installed (Debian package tinyproxy); .ci/run installs it")
    return found


@contextlib.contextmanager
def proxy_process(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A tinyproxy on a free loopback port (its URL), logging every request to a file (read
    it once the block ends: the proxy writes it out as it stops)."""
    port = free_port()
    # it drops to `nobody` before it opens its log: a folder `nobody` can reach (pytest's
    # own are private to root)
    home = Path(tempfile.mkdtemp(prefix="sweeper-tinyproxy-"))
    os.chmod(home, 0o777)  # noqa: S103 - a test's own temporary folder
    log = tmp_path / "tinyproxy.log"
    conf = home / "tinyproxy.conf"
    conf.write_text(f"User nobody\nGroup nogroup\nPort {port}\nListen 127.0.0.1\n"
                    f"Timeout 10\nLogFile \"{home / 'tinyproxy.log'}\"\nLogLevel Connect\n"
                    "MaxClients 20\nAllow 127.0.0.1\n")
    process = subprocess.Popen([tinyproxy(), "-d", "-c", str(conf)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:  # ready once it accepts a connection
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tinyproxy did not start: {log.read_text()}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", log
    finally:
        process.terminate()
        process.wait(10)
        with contextlib.suppress(FileNotFoundError):
            shutil.copy(home / "tinyproxy.log", log)
        shutil.rmtree(home, ignore_errors=True)


async def test_http_and_https_upstreams_go_through_the_proxy(tmp_path: Path) -> None:
    ca, server_tls, _ = certificates(tmp_path, require_client=False)
    with proxy_process(tmp_path) as (proxy, log):
        async with FakeUpstream() as plain, Wire(lambda n, head: [(0, NO_CONTENT)],
                                                 tls=server_tls) as secure:
            via = await delete(policies(plain.base_url, proxy=proxy))
            tunnelled = await delete(policies(secure.url, proxy=proxy, ca_file=str(ca)))
            direct = await delete(policies(plain.base_url, proxy="none"))
            secure_port = secure.url.rsplit(":", 1)[1]
        assert via.answer.status == tunnelled.answer.status == direct.answer.status == 204
    logged = log.read_text()  # written out as the proxy stops
    # the plain call as an absolute-form request, the https one as a CONNECT tunnel
    assert f"DELETE http://127.0.0.1:{plain.port}/carts/1 HTTP/1.1" in logged, logged
    assert f"CONNECT 127.0.0.1:{secure_port}" in logged, logged
    assert len(plain.calls()) == 2 and len(secure.requests) == 1


async def test_the_environments_proxy_and_no_proxy(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with proxy_process(tmp_path) as (proxy, _):
        async with FakeUpstream() as plain:
            monkeypatch.setenv("HTTP_PROXY", proxy)
            monkeypatch.delenv("NO_PROXY", raising=False)
            monkeypatch.delenv("no_proxy", raising=False)
            assert (await delete(policies(plain.base_url))).answer.status == 204
            monkeypatch.setenv("NO_PROXY", "127.0.0.1")
            assert (await delete(policies(plain.base_url))).answer.status == 204
    # the proxy says it carried a request in its Via header
    proxied, direct = plain.calls()
    assert "tinyproxy" in {k.lower(): v for k, v in proxied.headers.items()}.get("via", "")
    assert "via" not in {k.lower() for k in direct.headers}


async def test_a_proxy_that_refuses_the_tunnel_is_a_connect_error() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(refuse, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        result = await delete(policies("https://127.0.0.1:9", proxy=f"http://127.0.0.1:{port}"))
    assert result.answer == Answer(failure=Failure.CONNECT)


# -- mutual TLS ----------------------------------------------------------------------------

def certificates(tmp_path: Path, *, require_client: bool = True
                 ) -> tuple[Path, ssl.SSLContext, tuple[Path, Path]]:
    """A private CA (its PEM), a server context for 127.0.0.1 (requiring a client
    certificate from that CA), and a client certificate and key it signed."""
    now = datetime.now(UTC)

    def issue(subject: str, issuer: x509.Name | None, signer: Any, key: Any, *,
              ca: bool = False) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (x509.CertificateBuilder().subject_name(name)
                   .issuer_name(issuer or name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(minutes=1))
                   .not_valid_after(now + timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None),
                                  critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def pem(cert: x509.Certificate, key: Any, name: str) -> tuple[Path, Path]:
        cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_path, key_path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = issue("sweeper test CA", None, ca_key, ca_key, ca=True)
    ca_path, _ = pem(ca_cert, ca_key, "ca")
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = pem(issue("upstream", ca_cert.subject, ca_key, server_key), server_key, "server")
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = pem(issue("sweeper", ca_cert.subject, ca_key, client_key), client_key, "client")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca_path))
    context.load_cert_chain(*server)
    context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_NONE
    return ca_path, context, client


async def test_an_upstream_that_requires_a_client_certificate(tmp_path: Path) -> None:
    ca, server_tls, (cert, key) = certificates(tmp_path)
    async with Wire(lambda n, head: [(0, NO_CONTENT)], tls=server_tls) as wire:
        mutual = await delete(policies(wire.url, ca_file=str(ca), client_cert_file=str(cert),
                                       client_key_file=str(key)))
        without = await delete(policies(wire.url, ca_file=str(ca)))
        untrusted = await delete(policies(wire.url, client_cert_file=str(cert),
                                          client_key_file=str(key)))
    assert mutual.answer.status == 204
    assert without.answer.status is None and untrusted.answer.status is None
    assert len(wire.requests) == 1


def test_tls_files_are_checked_when_the_policies_file_is_read(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    for settings, key in (({"ca_file": missing}, "ca_file"),
                          ({"client_cert_file": missing, "client_key_file": missing},
                           "client_cert_file"),
                          ({"client_cert_file": missing}, "shop"),
                          ({"proxy": "https://proxy.example:3128"}, "proxy")):
        with pytest.raises(ConfigError) as refused:
            policies("https://api.example", **settings)
        assert f"upstreams.shop.{key}" in str(refused.value) or key in str(refused.value)

