"""A replica on a host of its own: a network namespace joined to this machine by a veth pair,
so that a drill cuts its links in the kernel, as a partition cuts them: packets dropped by
nftables on the host's end of the pair (no RST, no ICMP), requests, answers or both, while
TCP retransmits into the void; healed, the retransmissions go through and connections that
outlived the cut carry on.

PostgreSQL and the fake upstream listen on loopback only, so each link is a plain relay on
the host's end of the pair (drills/faultproxy.py, never faulted here): the faults are the
kernel's. Needs root (`ip netns`) and nftables, which the set-up installs from Debian when
it is missing."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from typing import Final, Literal

from drills.base import DrillSkipped
from drills.faultproxy import FaultProxy

LinkName = Literal["database", "upstream"]
# one /30 per namespace under 10.<second>.<index>.0; the second octet from the drill's pid
# keeps two drill runs on one machine apart
_SECOND_OCTET: Final = 128 + os.getpid() % 64


def _run(argv: tuple[str, ...], stdin: str | None, check: bool) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True,  # noqa: S603
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")


async def _sh(*argv: str, stdin: str | None = None, check: bool = True) -> None:
    """Run `argv` off the event loop; with `check`, a failure raises with its stderr."""
    await asyncio.to_thread(_run, argv, stdin, check)


async def _nftables() -> None:
    """nft, installed from Debian's packages if this machine lacks it."""
    if shutil.which("nft") is None:
        try:
            await _sh("apt-get", "install", "-y", "-q", "nftables")
        except (RuntimeError, OSError) as exc:
            raise DrillSkipped(f"nftables is missing and could not be installed: {exc}") \
                from None


class Namespace:
    """Host `index` of a drill: `open()` creates it, with a relay per link on the host's
    address; `cut()`/`heal()` drop a link's packets; `close()` removes everything."""

    def __init__(self, index: int) -> None:
        tag = f"{os.getpid() % 100_000}x{index}"
        self.name = f"sweeper-{tag}"
        self.host_if, self.inner_if = f"swh{tag}", f"swn{tag}"  # at most 15 characters
        self.host_address = f"10.{_SECOND_OCTET}.{index}.1"
        self.inner_address = f"10.{_SECOND_OCTET}.{index}.2"
        self.table = f"sweeper_{tag}"
        self.relays: dict[LinkName, FaultProxy] = {}
        self._opened = False

    async def open(self, targets: dict[LinkName, tuple[str, int]]) -> None:
        """Create the namespace and its veth pair, and a relay on the host's end to each
        target (host and port, or PostgreSQL's socket directory and port)."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise DrillSkipped("network namespaces need root and iproute2")
        await _nftables()
        self._opened = True
        await _sh("ip", "netns", "add", self.name)
        await _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name",
                  self.inner_if)
        await _sh("ip", "link", "set", self.inner_if, "netns", self.name)
        await _sh("ip", "addr", "add", f"{self.host_address}/30", "dev", self.host_if)
        await _sh("ip", "link", "set", self.host_if, "up")
        await _sh("ip", "-n", self.name, "addr", "add", f"{self.inner_address}/30", "dev",
                  self.inner_if)
        await _sh("ip", "-n", self.name, "link", "set", self.inner_if, "up")
        await _sh("ip", "-n", self.name, "link", "set", "lo", "up")
        for link, (host, port) in targets.items():
            relay = FaultProxy(host, port)
            await relay.start(self.host_address)
            self.relays[link] = relay
        # a cut link is its relay's port in a set: requests (arriving from the namespace)
        # and answers (leaving for it) are dropped by these two rules
        await _sh("nft", "-f", "-", stdin=f"""
table inet {self.table} {{
  set requests_cut {{ type inet_service; }}
  set answers_cut {{ type inet_service; }}
  chain inbound {{
    type filter hook input priority 0; policy accept;
    iifname "{self.host_if}" tcp dport @requests_cut drop
  }}
  chain outbound {{
    type filter hook output priority 0; policy accept;
    oifname "{self.host_if}" tcp sport @answers_cut drop
  }}
}}
""")

    def address(self, link: LinkName) -> tuple[str, int]:
        """Where a process in the namespace reaches `link`'s target."""
        return self.host_address, self.relays[link].port

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    async def cut(self, link: LinkName, *, requests: bool = True, answers: bool = True
                  ) -> None:
        port = str(self.relays[link].port)
        for cut, chosen in (("requests_cut", requests), ("answers_cut", answers)):
            if chosen:
                await _sh("nft", "add", "element", "inet", self.table, cut, f"{{ {port} }}")

    async def heal(self, link: LinkName) -> None:
        port = str(self.relays[link].port)
        for cut in ("requests_cut", "answers_cut"):
            # deleting an element the set does not hold fails: that direction was not cut
            await _sh("nft", "delete", "element", "inet", self.table, cut, f"{{ {port} }}",
                      check=False)

    async def close(self) -> None:
        """Remove the rules, the namespace (its end of the pair goes with it) and the
        relays; whatever of them exists."""
        for relay in self.relays.values():
            await relay.close()
        if not self._opened:
            return
        for argv in (("nft", "delete", "table", "inet", self.table),
                     ("ip", "link", "delete", self.host_if),
                     ("ip", "netns", "delete", self.name)):
            await _sh(*argv, check=False)
