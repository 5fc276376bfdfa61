"""What a command that runs the service does first: the settings and the policies file they
name, loaded and checked (`load_config`); the database to use, the configured one or an
embedded server for as long as the command runs (`database`, `database_server`); and the
heap start-up built, settled before a long-running process serves (`settle_heap`).
`sweeper drill` and the benchmarks start their processes the same way."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

from sqlalchemy.engine import URL

from service.config.policies import Policies, load_policies
from service.config.settings import (
    Settings,
    async_url,
    load_settings,
    plain_url,
    unknown_variables,
)
from service.errors import ConfigError
from service.observability import tracing
from service.observability.logs import configure_logging

# the logger the command's own lines (start-up warnings, "serving") have always carried, so
# the log queries that select on it keep finding them
COMMAND_LOGGER = "service.commands.cli"
log = logging.getLogger(COMMAND_LOGGER)


def load_config() -> tuple[Settings, Policies]:
    """Settings and the policies file they name, both validated; unknown SWEEPER_*
    variables are logged as warnings (they are ignored, so a misspelt one is a mistake)."""
    from service.budget.credential_waits import missing_key
    from service.credentials import Keyring

    settings = load_settings()
    policies = load_policies(settings.policies_file)
    problems = [*missing_key(policies, Keyring.from_settings(settings)),
                *policies.regions.serving_problems(settings.region)]
    if problems:
        raise ConfigError(*problems)
    configure_logging(settings)
    tracing.configure(os.environ)  # off unless OTEL_* variables ask (docs/operations.md)
    for warning in unknown_variables(os.environ):
        log.warning(warning)
    if policies.stores:
        from service.sweeps.store_checks import check_policies

        checked = asyncio.run(check_policies(policies))
        if checked.problems:
            raise ConfigError(*checked.problems)
        for warning in checked.warnings:
            log.warning(warning)
    return settings, policies


@contextmanager
def database(settings: Settings) -> Iterator[URL]:
    """The configured database URL, or an embedded server for as long as the block runs."""
    url = settings.sqlalchemy_url()
    if url is not None:
        yield url
        return
    from service.db.embedded import embedded_database

    with embedded_database(settings.data_dir) as embedded:
        yield async_url(embedded)


@contextmanager
def database_server(settings: Settings) -> Iterator[str]:
    """The plain postgresql:// URL of the configured database's server (or an embedded
    one), for commands that create databases of their own there (`sweeper drill`)."""
    with database(settings) as url:
        yield plain_url(url)


YOUNG_COLLECTION: Final = 10_000  # allocations less deallocations between two young passes


def settle_heap() -> None:
    """Exempt what start-up built (modules, the app, policies: ~130,000 objects) from the
    garbage collector's full passes, which walked all of it in tens of ms each, stalling
    every request and every call of a long-running process now and then. Objects made
    later are collected as usual, the youngest every YOUNG_COLLECTION allocations instead
    of every 700: a drain allocates thousands of short-lived objects per round."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION, *gc.get_threshold()[1:])
