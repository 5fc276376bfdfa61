"""A webhook source as the policies file declares it, resolved: its secrets read from the
environment (several during a rotation) and the headers its signature scheme takes (the
policies its rules name are checked on the entry as written, in service/config/
file_entries.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.config.policy_file import WebhookSourceConfig
from service.config.resolution import Resolution
from service.protocols.webhook_signatures import standard_key


@dataclass(frozen=True)
class WebhookSource:
    """A resolved webhook source with its secrets (several during rotation)."""

    name: str
    config: WebhookSourceConfig
    secrets: tuple[str, ...] = field(repr=False)


def resolve_webhook_source(name: str, src: WebhookSourceConfig, r: Resolution
                           ) -> WebhookSource | None:
    """The webhook source `name` with its secrets, or None when it has a problem (each
    noted in `r`; the policies its rules name are checked in service/config/
    file_entries.py)."""
    key, mark = f"webhooks.{name}", r.mark()
    names = ([src.secret_env] if src.secret_env else []) + list(src.secrets_env)
    if not names:
        r.fail(key, "set secret_env (or secrets_env for rotation)")
    secrets = tuple(r.secret(var, f"{key}.secret_env") for var in names)
    _scheme_problems(key, src, r)
    if src.scheme == "standard":
        for var, value in zip(names, secrets, strict=True):
            if value and not _standard_secret_ok(value):
                r.fail(f"{key}.secret_env", f"environment variable {var}: not a "
                                            "Standard Webhooks secret ('whsec_' + base64)")
    if r.found_since(mark):
        return None
    return WebhookSource(name=name, config=src, secrets=secrets)


def _scheme_problems(key: str, src: WebhookSourceConfig, r: Resolution) -> None:
    """The headers a source names, which only the hmac-sha256 scheme takes (and needs)."""
    if src.scheme == "hmac-sha256" and not src.signature_header:
        r.fail(f"{key}.signature_header", "required for scheme 'hmac-sha256'")
    for option in ("signature_header", "id_header", "topic_header"):
        if src.scheme != "hmac-sha256" and getattr(src, option) is not None:
            r.fail(f"{key}.{option}", f"only for scheme 'hmac-sha256' (scheme "
                                      f"{src.scheme!r} names its own headers)")


def _standard_secret_ok(secret: str) -> bool:
    try:
        standard_key(secret)
    except ValueError:
        return False
    return True
