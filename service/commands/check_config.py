"""`sweeper check-config`: every problem of the settings, the policies file (each store
statement checked against its store) and the database in one pass, then what was found.
`check_database` is what it says of the database: reached, and its schema against this
build's."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from service.commands.exits import Exit, report_problems, report_warnings
from service.config.policies import Policies, read_policies
from service.config.settings import Settings, read_settings, unknown_variables
from service.db.migrate import schema_revision
from service.errors import ConfigError, DatabaseUnavailable


def cmd_check_config(args: argparse.Namespace) -> int:
    """Every problem of the settings, the policies file and the database at once (each
    source checked as far as its own problems allow), then the warnings; exit 2 on a
    configuration problem, else 3 when the database cannot be reached."""
    settings, problems = read_settings()
    policies_file = _policies_file(settings)
    policies, found = read_policies(policies_file)
    problems += found
    report_warnings(_warnings(policies_file))
    if settings is not None:
        problems += _missing_keys(settings, policies)
        problems += policies.regions.serving_problems(settings.region)
    statements = _check_stores(policies, problems, explain=args.explain)
    database, down = "", None  # what is said of the database; why it cannot be reached
    try:
        database = check_database(settings) if settings is not None else ""
    except ConfigError as exc:
        problems += exc.problems
    except DatabaseUnavailable as exc:
        down = exc
    report_problems(problems)
    if down is not None:
        print(f"sweeper: database unavailable: {down}", file=sys.stderr)
    if problems or settings is None:
        return Exit.CONFIG
    if down is not None:
        return Exit.DATABASE
    _print_found(settings, policies, database, statements)
    return Exit.OK


def _policies_file(settings: Settings | None) -> Path | None:
    """The policies file the settings name; where no settings could be read, the one
    SWEEPER_POLICIES_FILE names, so that its problems are listed too."""
    if settings is not None:
        return settings.policies_file
    named = os.environ.get("SWEEPER_POLICIES_FILE")
    return Path(named) if named else None


def _warnings(policies_file: Path | None) -> list[str]:
    """SWEEPER_* variables nothing reads, and no policies file at all."""
    warnings = unknown_variables(os.environ)
    if policies_file is None:
        warnings.append("SWEEPER_POLICIES_FILE is not set: there are no policies, so no item "
                        "can be registered and no webhook accepted")
    return warnings


def _missing_keys(settings: Settings, policies: Policies) -> list[str]:
    """Stored credentials the policies ask for with no SWEEPER_CREDENTIALS_KEY to open
    them."""
    from service.budget.credential_waits import missing_key
    from service.credentials import Keyring

    return missing_key(policies, Keyring.from_settings(settings))


def _check_stores(policies: Policies, problems: list[str], *, explain: bool) -> list[str]:
    """Each store's statements checked against the store: their problems added to
    `problems`, their warnings printed; the statements (with their plans when `explain`)
    returned, to be shown once everything passed."""
    if not policies.stores:
        return []
    from service.sweeps.store_checks import check_policies

    checked = asyncio.run(check_policies(policies, explain=explain))
    problems += checked.problems
    report_warnings(checked.warnings)
    return checked.statements


def check_database(settings: Settings) -> str:
    """What check-config says of the database: the configured one reached, and its schema
    against this build's; the embedded one's folder. DatabaseUnavailable when it cannot be
    reached, ConfigError when the embedded one is not installed."""
    from service.db import embedded
    from service.db.migrate import head_revision

    url = settings.sqlalchemy_url()
    if url is None:
        if not embedded.installed():
            raise ConfigError(embedded.NOT_INSTALLED)
        return f"embedded, under {settings.data_dir}"
    revision = asyncio.run(schema_revision(url, settings))
    said = f"reachable, schema at {revision or 'nothing yet'}"
    if revision != head_revision():
        said += (f" (this build's is {head_revision()}: "
                 + ("`serve` migrates it at start)" if settings.migrate_on_start
                    else "run `sweeper migrate`, SWEEPER_MIGRATE_ON_START is off)"))
    return said


def _print_found(settings: Settings, policies: Policies, database: str,
                 statements: list[str]) -> None:
    """The `ok:` line, then each store statement and each list source's requests."""
    from service.sweeps.list_pages import describe_requests

    print(f"ok: {checked_summary(policies)}; database: {database}; evidence "
          f"exports: {signing_said(settings)}")
    for shown in statements:
        print(shown)
    for shown in describe_requests(policies):
        print(shown)


def checked_summary(policies: Policies) -> str:
    """What check-config found in the policies file, counted."""
    stores = f"{len(policies.stores)} store(s), " if policies.stores else ""
    regions = (f", {len(policies.regions.names)} region(s) pinning "
               f"{len(policies.regions.pins)} tenant(s)" if policies.regions.names else "")
    return (f"{len(policies.upstreams)} upstream(s), {stores}"
            f"{len(policies.policies)} policy(ies), "
            f"{len(policies.webhooks)} webhook source(s){regions} from {policies.source}")


def signing_said(settings: Settings) -> str:
    """How the process will sign evidence exports, as check-config says it."""
    signer = settings.evidence_signer()
    if signer is not None:
        return f"signed with key {signer.current.key_id}"
    if settings.database_url is None:
        return f"signed with the key under {settings.data_dir}"
    return "UNSIGNED (set SWEEPER_EVIDENCE_SIGNING_KEY_FILE)"
