"""Host names an item's ids may make: what a host name is (one canonical spelling, IPv4 only
in dotted decimal), which forms name an internal address by themselves (IP literals,
single-label names), and the probes a templated host's `host_pattern` must refuse: values
that escape the host, arbitrary hosts, and (without allow_private_addresses) internal ones.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

_LABEL: Final = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_NAME: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
MAX_HOST_CHARS: Final = 253
HOST_NAME_RULE: Final = ("ASCII letters, digits and '-' in dot-separated labels, "
                         "or an IPv4 address")


# A last label a resolver reads as a number (the WHATWG URL standard's "ends in a number";
# glibc's inet_aton likewise): all digits, or 0x and hex digits. Such a host is an address
# however it is spelled: `2130706433`, `0x7f000003`, `0177.0.0.1`, `127.1`, `0x7f.1`.
_NUMERIC_LABEL: Final = re.compile(r"[0-9]+|0x[0-9a-f]*", re.ASCII)


def host_name_problem(host: str) -> str | None:
    """Why `host` is no host name (compared lower-cased), or None. A last label that reads
    as a number makes the host an IPv4 address, which must then be in dotted decimal, four
    parts without leading zeros (`127.0.0.3`): the hex, octal, integer and short forms
    resolvers also take are refused. ASCII is checked before lower-casing: the Kelvin sign
    lower-cases to `k`."""
    if not host.isascii():
        return f"not a host name ({HOST_NAME_RULE})"
    host = host.lower()
    if len(host) > MAX_HOST_CHARS or not _HOST_NAME.fullmatch(host):
        return f"not a host name ({HOST_NAME_RULE})"
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return "not a host name (a last label that reads as a number makes it an IPv4 " \
                   "address, and only dotted decimal is taken: no hex, octal, integer or " \
                   "short forms)"
    return None


def internal_host_problem(host: str) -> str | None:
    """Why `host` (a host name: `host_name_problem` passed it) may name an internal address
    by its form alone, or None: an IPv4 literal names the address itself, and a single-label
    name (`localhost`, `metadata`) resolves through the search domains to a host inside the
    network. Only an upstream with allow_private_addresses takes them."""
    if "." not in host:
        return "a single-label name (it resolves to hosts inside the network)"
    if _NUMERIC_LABEL.fullmatch(host.rpartition(".")[2]):
        return "an IP address"
    return None


# Values a hostile item could carry into a host: each must make a host the pattern refuses,
# or a pattern lets a value escape the host (`.*\.myshopify\.com` accepts
# `evil.example/x.myshopify.com`).
HOSTILE_HOST_VALUES: Final = tuple(
    [f"evil.example{c}x" for c in "/?#@:\\ %[]"] + [f"a{c}b" for c in "/?#@:\\ %"])
# Hosts no allow-list of a real upstream accepts: a pattern that matches one accepts any host
# (the last is the cloud metadata address).
ARBITRARY_HOSTS: Final = ("evil.example", "sweeper-probe.invalid", "169.254.169.254")
# Values that make internal hosts: single-label names and IP literals. A host_pattern that
# accepts one needs allow_private_addresses (a heuristic: every call checks its host).
INTERNAL_HOST_VALUES: Final = ("localhost", "metadata", "a", "kubernetes", "internal",
                               "127.0.0.1", "127.0.0.3", "10.0.0.1", "172.16.0.1",
                               "192.168.0.1", "169.254.169.254", "0.0.0.0", "1.2.3.4")  # noqa: S104 - probes

# A run of literal host characters at the start or end of a pattern (`\\.myshopify\\.com`)
_LITERAL_RUN: Final = r"(?:\\[.-]|[A-Za-z0-9-])+"
_LEADING: Final = re.compile(rf"\^?({_LITERAL_RUN})")
_TRAILING: Final = re.compile(rf"({_LITERAL_RUN})\$?\Z")


def _affixes(pattern: str) -> tuple[str, str]:
    """The literal text a pattern starts and ends with, if any (`.*\\.myshopify\\.com` ends
    with `.myshopify.com`): hostile probes wear them, or a whole-host template would never
    meet the pattern with one."""
    lead, tail = _LEADING.match(pattern), _TRAILING.search(pattern)

    def literal(found: re.Match[str] | None) -> str:
        return "" if found is None else re.sub(r"\\(.)", r"\1", found[1])
    return literal(lead), literal(tail)


def _internal_values(prefix: str, suffix: str) -> list[str]:
    """INTERNAL_HOST_VALUES, also wearing the pattern's literal affixes, and completed to
    IPv4 literals where an affix is one in part (`127\\.0\\.0\\.[0-9]+` starts with
    `127.0.0.`)."""
    values = [*INTERNAL_HOST_VALUES]
    if prefix or suffix:
        values += [prefix + value + suffix for value in INTERNAL_HOST_VALUES]
    for parts in range(1, 5):
        numbers = ".".join(["1"] * parts)
        values += [prefix + numbers, numbers + suffix, prefix + numbers + suffix]
    return values


def host_pattern_problems(pattern: re.Pattern[str], host: list[tuple[str, str | None]], *,
                          allow_private: bool = False) -> list[str]:
    """Why `pattern` could let a value escape the host template, accept any host, or
    (without `allow_private`) make an internal one. (A heuristic, probing with hostile
    values: the host itself is checked on every call.)"""
    prefix, suffix = _affixes(pattern.pattern)

    def made_of(value: str) -> str:
        return "".join(literal + (value if name else "") for literal, name in host).lower()
    values = [*HOSTILE_HOST_VALUES,
              *(prefix + value + suffix for value in HOSTILE_HOST_VALUES if prefix or suffix)]
    for value in values:
        made = made_of(value)
        if pattern.fullmatch(made):
            return [f"accepts {made!r}, which is no host name (an item's id would carry the "
                    "call out of the host): allow only letters, digits, '-' and '.' where a "
                    "placeholder goes, e.g. '[a-z0-9-]+'"]
    accepted = [host for host in ARBITRARY_HOSTS if pattern.fullmatch(host)]
    if accepted:
        return [f"accepts any host (e.g. {accepted[0]!r}): anchor it to the upstream's own "
                f"domain, e.g. '[a-z0-9][a-z0-9-]*\\.myshopify\\.com'"]
    if allow_private:
        return []
    for value in _internal_values(prefix, suffix):
        made = made_of(value)
        if host_name_problem(made) is None and pattern.fullmatch(made):
            what = internal_host_problem(made)
            if what is not None:
                return [f"accepts {made!r}, {what}: anchor it to the upstream's own domain, "
                        "e.g. '[a-z0-9][a-z0-9-]*\\.myshopify\\.com', or set "
                        "allow_private_addresses = true on the upstream (for tests and "
                        "in-cluster services)"]
    return []
