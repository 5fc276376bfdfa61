"""An item's claims, calls and completions as spans of its own trace (tracing on:
service/observability/tracing.py), on whichever replica makes them: each is a child of the
span of the batch (or the webhook request) that released the item, whose `traceparent` the
lease carries.

    sweeper.claim_round   an admission round, its statements inside; a root, linked from
                          the claims it made
    sweeper.claim         the round as one item's trace sees it (the round's start and end)
    sweeper.call          one upstream call, its outcome; a batch call's span is in its first
                          item's trace, linked to the others'
    sweeper.flush         a write of outcomes, its statement inside; a root
    sweeper.complete      a call's outcomes from the moment they were known to their commit
                          (linked to the flush that wrote them)

Spans carry ledger ids, policies and outcomes, never object ids unless the policy's
`tracing.object_ids` allows. With tracing off every method returns at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanContext, SpanKind

from service.config.policies import Policy
from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.observability import tracing
from service.observability.failures import InternalErrors
from service.observability.metrics import Where
from service.upstreams.deletion_api import CallResult

MAX_LINKS: Final = 32  # a batch call links to at most this many other items' traces

P = ParamSpec("P")
R = TypeVar("R")
_ERRORS: Final = InternalErrors(logging.getLogger("service.worker"))


@dataclass(frozen=True)
class ClaimRound:
    """An admission round's span, and when it began and ended (ns since the epoch)."""

    context: SpanContext
    started_ns: int
    ended_ns: int


def _never_raises(method: Callable[P, R]) -> Callable[P, R | None]:
    """A span that cannot be made is an internal error, never a lost outcome or lease."""

    @functools.wraps(method)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            _ERRORS.caught(Where.TRACING, exc)
            return None

    return guarded


class CallTraces:
    """The spans of one pool's rounds, calls and completions (`tracer` None: none). No
    method raises: tracing never costs an outcome."""

    def __init__(self, tracer: trace.Tracer | None) -> None:
        self._tracer = tracer
        # a call's span and when its outcomes were known, by item, until they commit
        self._answered: dict[int, tuple[SpanContext, int]] = {}

    @contextlib.contextmanager
    def claim_round(self) -> Iterator[list[ClaimRound]]:
        """Around an admission: the round's span current (its statements are its children);
        the list it yields holds the round once the block ends."""
        done: list[ClaimRound] = []
        if self._tracer is None:
            yield done
            return
        started = time.time_ns()
        with self._tracer.start_as_current_span("sweeper.claim_round") as span:
            yield done
        done.append(ClaimRound(span.get_span_context(), started, time.time_ns()))

    @_never_raises
    def call(self, call: Sequence[Lease], policy: Policy | None,
             claim: ClaimRound | None) -> Span | None:
        """Start the span of a call about to be made, in its first item's trace, after that
        item's claim."""
        lease = call[0]
        if self._tracer is None or tracing.unsampled(lease.trace_parent):
            # a trace the sampler left out: its children are not recorded either (the
            # default samplers decide by the parent or the trace id), so none is made
            return None
        # no stored context: a trace of its own, whatever is current here
        parent = tracing.stored_context(lease.trace_parent) or Context()
        links = []
        if claim is not None:
            links.append(Link(claim.context))
            self._tracer.start_span("sweeper.claim", context=parent, links=links,
                                    start_time=claim.started_ns).end(claim.ended_ns)
        others = {each.trace_parent for each in call[1:]} - {lease.trace_parent, None}
        for other in sorted(others, key=str)[:MAX_LINKS]:
            context = trace.get_current_span(tracing.stored_context(other)).get_span_context()
            links.append(Link(context))
        attributes: dict[str, str | int | list[str] | list[int]] = {
            "sweeper.policy": lease.policy, "sweeper.item.id": lease.item_id,
            "sweeper.attempt": lease.attempt, "sweeper.items": len(call)}
        if len(call) > 1:
            attributes["sweeper.item.ids"] = [each.item_id for each in call]
        if policy is not None and policy.config.tracing.object_ids:
            attributes["sweeper.object.ids"] = [each.object_id for each in call]
        return self._tracer.start_span("sweeper.call", context=parent, kind=SpanKind.CLIENT,
                                       links=links, attributes=attributes)

    @staticmethod
    def current(span: Span | None) -> contextlib.AbstractContextManager[object]:
        """`span` current for the block (an attempt's log line and the outgoing
        `traceparent` name it); nothing with tracing off."""
        if span is None:
            return contextlib.nullcontext()
        return trace.use_span(span, end_on_exit=False)

    @staticmethod
    @_never_raises
    def not_made(span: Span | None, reason: str) -> None:
        """The call was not made (its lease goes back): the span ends saying why."""
        if span is not None:
            span.set_attribute("sweeper.not_made", reason)
            span.end()

    @_never_raises
    def answered(self, span: Span | None, result: CallResult,
                 completions: Sequence[Completion]) -> None:
        """The call's answer and its items' outcomes, waiting for the next flush."""
        if span is None:
            return
        if result.answer.status is not None:
            span.set_attribute("http.response.status_code", result.answer.status)
        span.set_attribute("sweeper.outcome", sorted({c.outcome for c in completions}))
        span.end()
        now = time.time_ns()
        for completion in completions:
            self._answered[completion.lease.item_id] = (span.get_span_context(), now)

    @contextlib.contextmanager
    def flush(self, outcomes: int) -> Iterator[SpanContext | None]:
        """Around a write of outcomes: the flush's span current (its statement is its
        child)."""
        if self._tracer is None:
            yield None
            return
        with self._tracer.start_as_current_span(
                "sweeper.flush", attributes={"sweeper.items": outcomes}) as span:
            yield span.get_span_context()

    @_never_raises
    def completed(self, batch: Sequence[Completion], fenced: Sequence[int],
                  flush: SpanContext | None) -> None:
        """Each call's completion span, ended now that its outcomes are committed (or
        fenced: the lease was no longer this pool's, and nothing was written)."""
        if self._tracer is None or flush is None:
            return
        refused = set(fenced)
        # by call (a span context holds its trace state, a mapping: not hashable itself)
        calls: dict[tuple[int, int], tuple[SpanContext, int, list[Completion]]] = {}
        for completion in batch:
            found = self._answered.pop(completion.lease.item_id, None)
            if found is not None:
                call, answered_ns = found
                key = (call.trace_id, call.span_id)
                calls.setdefault(key, (call, answered_ns, []))[2].append(completion)
        for call, answered_ns, completions in calls.values():
            self._tracer.start_span(
                "sweeper.complete",
                context=trace.set_span_in_context(trace.NonRecordingSpan(call)),
                links=[Link(flush)], start_time=answered_ns, attributes={
                    "sweeper.status": sorted({c.status for c in completions}),
                    "sweeper.fenced": sum(c.lease.item_id in refused for c in completions),
                }).end()
