"""One exchange with an upstream: a request sent through an httpx transport within an
overall deadline (httpx's read timeout is per chunk: a dripping upstream must not hold a
lease forever), its answer read as the client needs it, and every transport error mapped
here, once, to :class:`service.outcomes.Failure`, by what the upstream may have seen:

    httpx.TransportError
    ├── AddressRefused (service/protocols/egress.py)  -> PRIVATE_ADDRESS (never connected)
    ├── ConnectError, ConnectTimeout, PoolTimeout   -> CONNECT / TIMEOUT_BEFORE_SEND (not sent)
    ├── WriteTimeout, WriteError                    -> TIMEOUT_AFTER_SEND (may have been read)
    ├── ReadTimeout, overall deadline               -> TIMEOUT_AFTER_SEND
    ├── ReadError, RemoteProtocolError              -> RESET_AFTER_SEND
    ├── LocalProtocolError (a header with a CR/LF)  -> INVALID_REQUEST (not sent)
    ├── SentTooLate (past the call's send_by)       -> SENT_TOO_LATE (not sent)
    ├── Withheld (the call's gate said no)          -> WITHHELD (not sent)
    │   (an answer without the upstream's echo_header value -> ECHO_MISMATCH, may be sent)
    └── other protocol errors                       -> PROTOCOL

An answer's body is read up to a small cap and dropped, except where the caller wants it
(a policy's answer rules, service/config/answer_rules.py): then whole up to the caller's cap,
never in part.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final

import httpx

from service.outcomes import Answer, Failure
from service.protocols.egress import AddressRefused
from service.protocols.transport import Http1Transport, SentTooLate, Withheld
from service.upstreams.deadlines import deadlines

BODY_CAP_BYTES: Final = 4096  # of a body nobody reads, drained so its connection is reused

# The statuses that can record a deletion (2xx; 404 and 410 where absent means deleted):
# with an echo header, these count only with the request's own value echoed.
SUCCESS_STATUSES: Final = frozenset(range(200, 300))
DELETING_STATUSES: Final = SUCCESS_STATUSES | {404, 410}

# The tree above as a table: the first entry an error is an instance of names its failure.
_FAILURES: Final[tuple[tuple[type[Exception] | tuple[type[Exception], ...], Failure], ...]] = (
    (AddressRefused, Failure.PRIVATE_ADDRESS),
    (httpx.ConnectError, Failure.CONNECT),
    ((httpx.ConnectTimeout, httpx.PoolTimeout), Failure.TIMEOUT_BEFORE_SEND),
    ((httpx.WriteTimeout, httpx.WriteError, httpx.ReadTimeout), Failure.TIMEOUT_AFTER_SEND),
    ((httpx.ReadError, httpx.RemoteProtocolError), Failure.RESET_AFTER_SEND),
    (httpx.LocalProtocolError, Failure.INVALID_REQUEST),
    (SentTooLate, Failure.SENT_TOO_LATE),
    (Withheld, Failure.WITHHELD),
)


async def send(transport: httpx.AsyncBaseTransport, request: httpx.Request,
               deadline_seconds: float, wants_body: Callable[[int], bool], cap: int, *,
               echo: tuple[str, str] | None = None,
               echoed: Collection[int] = DELETING_STATUSES) -> Answer:
    """Send `request` within an overall deadline: the answer's status and rate-limit
    headers, its body (up to `cap` bytes, never a part) where `wants_body(status)`, or how
    the call failed (the mapping in this module's docstring). With `echo` (a header and the
    value this request sent in it), an answer with a status in `echoed` (one that could
    record a deletion) without that value is ECHO_MISMATCH: it may be another request's."""
    try:
        with deadlines().within(deadline_seconds):
            response, body = await _exchange(transport, request, wants_body, cap)
    except TimeoutError:
        return Answer(failure=Failure.TIMEOUT_AFTER_SEND)
    except httpx.TransportError as exc:
        return failure_of(exc)
    if echo is not None and response.status_code in echoed \
            and response.headers.get(echo[0]) != echo[1]:
        if isinstance(transport, Http1Transport):  # (httpx's own transports cannot)
            transport.distrust(request.url, "echo_mismatch")
        return Answer(failure=Failure.ECHO_MISMATCH)
    # RateLimit, X-RateLimit-* and BigCommerce's X-Rate-Limit-* (outcomes.exhausted_for)
    limits = {k: v for k, v in response.headers.items()
              if "ratelimit" in k or k.startswith("x-rate-limit-")}
    return Answer(status=response.status_code, retry_after=response.headers.get("retry-after"),
                  rate_limits=limits or None, body=body,
                  location=response.headers.get("location")
                  if 300 <= response.status_code < 400 else None)


def failure_of(exc: httpx.TransportError) -> Answer:
    """The failure a transport error stands for (this module's docstring)."""
    for kinds, failure in _FAILURES:
        if isinstance(exc, kinds):
            if failure is Failure.PRIVATE_ADDRESS:  # the host and the address it refused
                return Answer(failure=failure, detail=str(exc).split(",", 1)[0])
            return Answer(failure=failure)
    return Answer(failure=Failure.PROTOCOL)


async def _exchange(transport: httpx.AsyncBaseTransport, request: httpx.Request,
                    wants_body: Callable[[int], bool], cap: int
                    ) -> tuple[httpx.Response, bytes | None]:
    """The answer to `request`, and its body where wanted; the response is closed (its
    connection released) before this returns."""
    response = await transport.handle_async_request(request)
    try:
        if wants_body(response.status_code) and _identity(response):
            return response, await _read_capped(response, cap)
        await _drain_capped(response)
        return response, None
    finally:
        await response.aclose()


async def _drain_capped(response: httpx.Response) -> None:
    """Read at most BODY_CAP_BYTES of the body so the connection can be reused, no more.
    The transport's stream is read directly (aiter_raw's chunker and byte counting cost
    more than the reading); closing the response afterwards releases the connection."""
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise RuntimeError("an async transport answered with a sync stream")
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen >= BODY_CAP_BYTES:
            break


def _identity(response: httpx.Response) -> bool:
    """The body is sent as is (no Accept-Encoding is sent, so an upstream should not
    compress it; a compressed one is not read: rules on its body do not match)."""
    return response.headers.get("content-encoding", "identity").lower() in ("identity", "")


async def _read_capped(response: httpx.Response, cap: int) -> bytes | None:
    """The whole body when it is at most `cap` bytes, else None: a body is never read in
    part, so no rule ever sees half a document."""
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise RuntimeError("an async transport answered with a sync stream")
    chunks: list[bytes] = []
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen > cap:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
