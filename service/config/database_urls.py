"""The database's URL in the forms each client reads: SQLAlchemy's (`async_url`, with the
asyncpg driver) and asyncpg's own (`plain_url`), one host or several (libpq's multi-host
form, as managed PostgreSQL services hand it out)."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from sqlalchemy.engine import URL, make_url


def sqlalchemy_hosts(raw: str) -> str:
    """A libpq multi-host URL, as managed PostgreSQL services hand them out
    (`postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write`), in the form
    SQLAlchemy reads (`postgresql://u@/db?host=h1:5432&host=h2:5432&...`); any other URL as
    it is. libpq tries the hosts in order, and asyncpg does the same with either form."""
    parts = urlsplit(raw)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return raw
    if "[" in hosts:
        # SQLAlchemy's asyncpg dialect splits each host at its colon
        raise ValueError("a URL of several hosts names them by name or IPv4 address, not "
                         "as IPv6 literals")
    params = parse_qsl(parts.query)
    # every host with its port (SQLAlchemy's asyncpg dialect needs them all): libpq's
    # default for a host without one is the `port` parameter, else 5432
    default = next((v for k, v in params if k == "port"), "5432")
    named = [unquote(host) for host in hosts.split(",")]  # a socket directory: %2Fpath
    if not all(named):
        raise ValueError("a URL of several hosts has an empty one in its list")
    with_ports = [host if re.search(r":\d+$", host) else f"{host}:{default}"
                  for host in named]
    query = [*(("host", host) for host in with_ports), *((k, v) for k, v in params
                                                           if k != "port")]
    # by hand: urlunsplit drops the `//` of an empty host
    return f"{parts.scheme}://{userinfo}{at}{parts.path}?{urlencode(query)}"


def async_url(raw: str) -> URL:
    """Normalise any postgresql URL (one host or several) to the asyncpg driver SQLAlchemy
    needs."""
    return make_url(sqlalchemy_hosts(raw)).set(drivername="postgresql+asyncpg")


def plain_url(url: URL) -> str:
    """`url` as a plain postgresql:// DSN (password included), for asyncpg's own
    connections (LISTEN, the webhook intake's pool) and for naming a server; several hosts
    in libpq's form, which asyncpg reads."""
    plain = url.set(drivername="postgresql")
    hosts = plain.query.get("host")
    if not isinstance(hosts, tuple):
        return plain.render_as_string(hide_password=False)
    userinfo = quote(plain.username or "", safe="")
    if plain.password is not None:
        userinfo += ":" + quote(str(plain.password), safe="")
    query = urlencode([(k, v) for k, values in plain.query.items() if k != "host"
                       for v in ((values,) if isinstance(values, str) else values)])
    listed = ",".join(quote(host, safe=":[]") for host in hosts)  # a socket directory too
    return (f"postgresql://{userinfo}{'@' if userinfo else ''}{listed}"
            f"/{quote(plain.database or '', safe='')}{'?' + query if query else ''}")
