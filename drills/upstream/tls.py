"""TLS for the fake: a self-signed certificate for its loopback address, made at start.

The certificate (no key) is written where clients read it as their CA file (an upstream's
`ca_file`), so a client verifies the fake as it would a real upstream behind a private CA.
An ECDSA P-256 key, as most public upstreams now serve: the handshake's CPU is the one a
client pays in production, not an RSA-2048 one.
"""

from __future__ import annotations

import ipaddress
import ssl
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed_context(host: str, cert_out: Path) -> ssl.SSLContext:
    """A server context with a fresh certificate for `host` (an IP address or a name),
    valid for a day; the certificate alone is written to `cert_out`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sweeper fake upstream")])
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        alt = x509.DNSName(host)
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_out.write_bytes(cert_pem)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # load_cert_chain reads files only: the pair goes through a private temporary file
    with tempfile.NamedTemporaryFile(suffix=".pem") as pair:
        pair.write(cert_pem + key_pem)
        pair.flush()
        context.load_cert_chain(pair.name)
    return context
