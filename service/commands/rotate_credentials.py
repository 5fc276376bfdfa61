"""`sweeper credentials rotate-key`: every tenant credential stored through the API
re-encrypted under the current SWEEPER_CREDENTIALS_KEY, so the previous keys can be
removed."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from sqlalchemy.engine import URL

from service.commands.exits import Exit
from service.commands.startup import database
from service.config.settings import Settings, load_settings
from service.db.migrate import on_database
from service.errors import ConfigError
from service.observability.logs import configure_logging

if TYPE_CHECKING:
    from service.credentials import Keyring
    from service.credentials.tenant_credentials import Reencryption


def cmd_rotate_credentials_key(_args: argparse.Namespace) -> int:
    """Re-encrypt every stored credential under SWEEPER_CREDENTIALS_KEY; exit 1 if some
    row opens under no configured key (each is logged with its tenant and upstream)."""
    from service.credentials import Keyring

    settings = load_settings()
    configure_logging(settings)
    keyring = Keyring.from_settings(settings)
    if keyring is None:
        raise ConfigError("SWEEPER_CREDENTIALS_KEY: must be set: stored credentials are "
                          "re-encrypted under it")
    with database(settings) as url:
        done = asyncio.run(_reencrypt(url, settings, keyring))
    print(f"{done.reencrypted} credential(s) re-encrypted under key {keyring.current_id}, "
          f"{done.replaced_meanwhile} replaced meanwhile, {len(done.unreadable)} unreadable")
    return Exit.INCOMPLETE if done.unreadable else Exit.OK


async def _reencrypt(url: URL, settings: Settings, keyring: Keyring) -> Reencryption:
    from service.credentials import tenant_credentials

    return await on_database(url, settings, lambda engine: tenant_credentials.reencrypt(
        engine, keyring, actor="cli:credentials rotate-key"))
