"""FakeUpstream: a real, misbehaving HTTP/1.1 "deletion API" on loopback, for Sweeper's tests,
drills and benchmarks. It ships in the package because ``sweeper drill`` starts it on an
operator's machine.

Which module owns what (each imports only the ones listed before it):

- `wire`:    HTTP/1.1 framing on asyncio streams (stdlib only: the faults need raw socket
             control): parsing a request, writing a response.
- `arrivals`: `ArrivalSocket`: each request timed by the kernel's stamp of its arrival,
             not by when the fake's loop got to it.
- `calls`:   `Call`, one recorded deletion call, and the counters read back (throttled
             calls, calls in flight).
- `limits`:  rate limits per scope: token bucket or sliding window, the 429's Retry-After.
- `faults`:  `Fault` kinds, their queue, and how each one answers a call.
- `control`: the control surface: the test API (`Controls`) and the ``/_control`` routes.
- `tls`:     a self-signed certificate and server context for HTTPS, made at start.
- `server`:  `FakeUpstream`: lifecycle (async or in a thread), connections, deletion calls.
- `cli`:     ``python -m drills.upstream --port 0 --default-limit 20 --ready-file PATH``
             (``--tls-cert-out PATH``: HTTPS; ``--latency-ms 50-200``: slow answers)
             (``python -m tests.fakes.upstream`` runs the same).
"""

from drills.upstream.calls import Call
from drills.upstream.cli import main
from drills.upstream.faults import Fault
from drills.upstream.server import FakeUpstream

__all__ = ["Call", "FakeUpstream", "Fault", "main"]
