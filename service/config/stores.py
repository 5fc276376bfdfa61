"""A store as the policies file declares it, resolved (its DSN read from the environment), and
what the file alone tells of a policy's store parts: their statements' text and the keys they
go with (the stores they name are checked in service/config/file_entries.py; service/sweeps/
store_databases.py checks the rest against the store itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from service.config import store_statements
from service.config.placeholders import template_fields
from service.config.policy_file import PolicyConfig, SourceConfig, StoreConfig, TargetConfig
from service.config.resolution import Resolution


@dataclass(frozen=True)
class Store:
    """A resolved store database: its config and the DSN read from the environment."""

    name: str
    config: StoreConfig
    dsn: str = field(repr=False)


def resolve_store(name: str, config: StoreConfig, r: Resolution) -> Store | None:
    """The store `name` with its DSN, or None when the DSN is not set (noted in `r`): a
    store without one is never connected to."""
    dsn = r.secret(config.dsn_env, f"stores.{name}.dsn_env")
    return Store(name=name, config=config, dsn=dsn) if dsn else None


_SOURCE_KINDS: Final = frozenset({"select", "with"})
_TARGET_KINDS: Final = frozenset({"delete", "update", "with"})
# what an HTTP call is made of: meaningless for a statement on a store
_HTTP_ONLY: Final = ("method", "body", "answers", "cost", "initial_object_version")


def store_problems(key: str, pol: PolicyConfig, r: Resolution) -> None:
    """The checks of a policy's source, target and guard that the file alone can tell
    (the stores they name are checked on the entry as written, by service/config/
    file_entries.py); problems go to `r`."""
    if isinstance(pol.source, SourceConfig):
        for problem in store_statements.problems(pol.source.query, kinds=_SOURCE_KINDS,
                                                 required=frozenset({"cutoff"}),
                                                 allowed=frozenset({"cutoff"})):
            r.fail(f"{key}.source.query", problem)
    if pol.guard is not None and pol.guard.query is not None:
        for problem in store_statements.problems(pol.guard.query, kinds=_SOURCE_KINDS,
                                                 required=frozenset(), allowed=frozenset()):
            r.fail(f"{key}.guard.query", problem)
    if pol.target is not None:
        _target_problems(key, pol, pol.target, r)
        _target_budget_problems(key, pol, pol.target, r)
    elif pol.guard is not None:
        r.fail(f"{key}.guard", "a guard yields a store target's deletions: this policy "
                               "has no target")


def _target_problems(key: str, pol: PolicyConfig, target: TargetConfig,
                     r: Resolution) -> None:
    """A store target's statement, and the keys of an HTTP call it cannot go with."""
    for problem in store_statements.problems(target.statement, kinds=_TARGET_KINDS,
                                             required=frozenset({"object_ids", "cutoff"}),
                                             allowed=frozenset({"object_ids", "cutoff"}),
                                             returning=True):
        r.fail(f"{key}.target.statement", problem)
    if pol.upstream is not None or pol.path is not None:
        r.fail(f"{key}.upstream" if pol.upstream is not None else f"{key}.path",
               "a policy with a store target calls no upstream")
    for option in _HTTP_ONLY:
        if option in pol.model_fields_set:
            r.fail(f"{key}.{option}", "is for an upstream's HTTP call, not a store target")
    if pol.confirm is not None:
        r.fail(f"{key}.confirm", "a confirmation read is for an upstream's deletions, not "
                                 "supported with a store target (its statement's RETURNING "
                                 "already names the rows it deleted)")


def _target_budget_problems(key: str, pol: PolicyConfig, target: TargetConfig,
                            r: Resolution) -> None:
    """A store target's batches, budget and lease."""
    if pol.batch is not None and "policy" not in template_fields(pol.scope):
        # a statement is one policy's, and a token one statement of the scope's
        r.fail(f"{key}.scope", "a store target with batch needs a scope holding {policy}, "
                               "e.g. \"store:{upstream}:{policy}\" ({upstream} is the store)")
    if pol.batch is not None and pol.batch.failed is not None:
        r.fail(f"{key}.batch.failed", "is for an upstream's answer: a statement returns the "
                                      "rows it deleted")
    if pol.rate.unit not in ("calls", "rows"):
        r.fail(f"{key}.rate.unit", "a store target's budget counts calls (statements) or rows")
    # a statement past its timeout has ended before its lease does: no second worker runs
    # the same batch while the first still might
    longest = (target.lock_timeout_ms + target.statement_timeout_ms) / 1000
    if longest >= pol.lease_seconds:
        r.fail(f"{key}.lease_seconds", f"must be longer than the target's lock and statement "
                                       f"timeouts together ({longest:g} s)")
