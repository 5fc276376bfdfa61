"""What a finished call makes of its items: its answer classified once (service/outcomes.py),
its scope effects noted once (service/budget/answer_effects.py: into the pool's signal buffer,
and its own local holds at once), and each item's next step planned by its own attempt count,
as the Completion the pool commits.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from datetime import datetime
from typing import Final

from service.budget import answer_effects
from service.config.answer_rules import NOTHING_READ, Costs, Reading
from service.config.policies import Policy
from service.config.policy_file import PolicyConfig
from service.ledger.claims import Lease
from service.ledger.completions import Completion
from service.observability.failures import InternalErrors
from service.observability.metrics import Where
from service.outcomes import (
    NOT_CONFIRMED,
    Classified,
    Outcome,
    classify,
    classify_confirmation,
    plan,
)
from service.upstreams.deletion_api import CallResult
from service.worker.calls import Call, is_confirmation_read
from service.worker.pacing import LocalHolds
from service.worker.ports import Clock
from service.worker.signals import SignalBuffer

log = logging.getLogger("service.worker")

# A store target's object whose row no longer matched the statement's predicate
SKIPPED: Final = Classified(Outcome.SKIPPED, "predicate_no_longer_holds")


class AttemptOutcomes:
    """The completions of the calls a pool named `worker` made."""

    def __init__(self, worker: str, clock: Clock, signals: SignalBuffer, holds: LocalHolds,
                 errors: InternalErrors, rng: random.Random) -> None:
        self._worker = worker
        self._clock = clock
        self._signals = signals
        self._holds = holds
        self._errors = errors
        self._rng = rng

    def of(self, call: Call, policy: Policy | None, result: CallResult, started: datetime,
           reason_override: str | None) -> list[Completion]:
        """The outcome of one call for each of its items: classified once, its scope
        effects noted once, and each item planned by its own attempt count (an object the
        answer names as failed is retried alone, as a transient). `reason_override`: the
        call was not made for that reason (its policy's version is gone)."""
        finished = self._clock.now()
        lease = call[0]
        if policy is not None and reason_override is None and is_confirmation_read(policy, call):
            return [self._confirmation(lease, policy, result, started, finished)]
        cfg = policy.config if policy is not None else None
        reading = self._reading(policy if reason_override is None else None, result)
        verdict = result.verdict or classify(
            result.answer, now=finished, ruled=_ruled(reading.verdict, lease, cfg),
            absent_means_deleted=bool(cfg and cfg.absent_means_deleted))
        if cfg is not None and reason_override is None:
            self._effects(lease, answer_effects.effects_of(
                verdict, result.answer, cfg, finished, reading.costs))
        failed = reading.failed if verdict.outcome is Outcome.SUCCEEDED else None
        own = result.verdicts
        # a deletion that answered success on an item whose policy confirms it goes back
        # pending, to be claimed again (budget, lease, holds, send gate and all) for its read
        confirms = policy is not None and reason_override is None and len(call) == 1 \
            and policy.confirm_request is not None and policy.confirms(lease.operation_key)
        return [self._completion(each, cfg, result, own.get(each.object_id) or (
                                 SKIPPED if each.object_id in result.skipped else verdict),
                                 started, finished, reason_override, failed, confirms)
                for each in call]

    def _reading(self, policy: Policy | None, result: CallResult) -> Reading:
        """What the policy's answer rules read of the answer (a store statement's rows as
        its cost); nothing for a call not made."""
        answer = result.answer
        if result.rows is not None:
            return Reading(None, Costs(actual=result.rows, available=None))
        if policy is None or answer.status is None or policy.answers.reads_nothing:
            return NOTHING_READ
        try:
            return policy.answers.read(answer.status, answer.body)
        except Exception as exc:
            # an answer the rules cannot read is read by its status alone: a hostile body
            # must never leave an item without an outcome
            self._errors.caught(Where.ANSWER_RULES, exc, policy=policy.name)
            return NOTHING_READ

    def _effects(self, lease: Lease, effects: answer_effects.ScopeEffects) -> None:
        """Note an answer's effects on its scope, and hold the scope back here at once."""
        scope = lease.scope
        self._signals.note(lease.policy, scope, effects)
        if effects.hold_seconds is not None:
            self._holds.hold(scope, self._clock.monotonic() + effects.hold_seconds)

    def _confirmation(self, lease: Lease, policy: Policy, result: CallResult,
                      started: datetime, finished: datetime) -> Completion:
        """The outcome of a confirmation read: succeeded (confirmed) when it found the
        object absent; a deletion again, with the same key, when it found the object served
        (`not_confirmed`, an attempt counted); the read again after a failure of its own.
        Its answer acts on the scope as a deletion's would (a 429 closes it)."""
        cfg = policy.config
        confirm = cfg.confirm
        absent = confirm.absent if confirm is not None else ()
        verdict = classify_confirmation(result.answer, absent=absent, now=finished)
        self._effects(lease, answer_effects.effects_of(verdict, result.answer, cfg,
                                                             finished))
        done = self._completion(lease, cfg, result, verdict, started, finished, None, None,
                                False)
        confirmed = verdict.outcome is Outcome.SUCCEEDED
        again = done.status == "pending" and verdict.reason != NOT_CONFIRMED
        return dataclasses.replace(done, confirmed=confirmed, to_confirm=again)

    def _completion(self, lease: Lease, cfg: PolicyConfig | None, result: CallResult,
                    verdict: Classified, started: datetime, finished: datetime,
                    reason_override: str | None, failed: frozenset[str] | None,
                    confirms: bool = False) -> Completion:
        if failed and lease.object_id in failed:
            verdict = Classified(Outcome.TRANSIENT, verdict.reason + ":object_failed")
        if cfg is None or reason_override is not None:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=1, backoff_base_s=1,
                             backoff_max_s=1, retry_after_max_s=1, jitter=0)
        else:
            next_step = plan(verdict, attempt=lease.attempt, max_attempts=cfg.max_attempts,
                             backoff_base_s=cfg.backoff.base_seconds,
                             backoff_max_s=cfg.backoff.max_seconds,
                             retry_after_max_s=cfg.retry_after_max_seconds,
                             jitter=self._rng.random())
        to_confirm = confirms and next_step.status == "succeeded"
        if to_confirm:
            # not succeeded until a read finds the object gone: pending at once, and the
            # attempt given back, so an attempt is one deletion and its read together
            next_step = dataclasses.replace(next_step, status="pending", retry_in_seconds=0.0,
                                            refund_attempt=True)
        _log_attempt(lease, verdict, result)
        return Completion(
            lease=lease, worker=self._worker, outcome=verdict.outcome.value,
            status=next_step.status, reason=reason_override or next_step.reason,
            http_status=result.answer.status,
            retry_after_seconds=(verdict.retry_after_seconds
                                 if verdict.outcome is Outcome.THROTTLED else None),
            retry_in_seconds=next_step.retry_in_seconds, refund_attempt=next_step.refund_attempt,
            started_at=started, finished_at=finished, latency_ms=result.latency_ms,
            object_version=verdict.version, to_confirm=to_confirm)


def _ruled(ruled: Classified | None, lease: Lease, cfg: PolicyConfig | None
           ) -> Classified | None:
    """The answer rules' verdict; a conflict naming the version just sent (a concurrent
    writer) backs off like any transient: retrying at once would spend the attempts in
    seconds."""
    if ruled is not None and ruled.version is not None and ruled.version == (
            lease.object_version or (cfg.initial_object_version if cfg else None)):
        return Classified(ruled.outcome, ruled.reason + ":same_version")
    return ruled


def _log_attempt(lease: Lease, verdict: Classified, result: CallResult) -> None:
    """One line per attempt: successes (the bulk) at DEBUG, anything else at INFO."""
    level = logging.DEBUG if verdict.outcome is Outcome.SUCCEEDED else logging.INFO
    if log.isEnabledFor(level):  # the extra dict is built only for a line written
        log.log(level, "attempt", extra={
            "item_id": lease.item_id, "batch_id": lease.batch_id,
            "operation_key": lease.operation_key,
            "policy": lease.policy, "scope": lease.scope, "outcome": verdict.outcome.value,
            "http_status": result.answer.status, "attempt": lease.attempt})
