"""A webhook source as the policies file declares it, resolved: its secrets read from the
environment (several during a rotation) and the headers its signature scheme takes (the
policies its rules name are checked on the entry as written, in service/config/
file_entries.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

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
    for var, value in zip(names, secrets, strict=True):
        if value and src.scheme == "standard" and not _standard_secret_ok(value):
            r.fail(f"{key}.secret_env", f"environment variable {var}: not a "
                                        "Standard Webhooks secret ('whsec_' + base64)")
        if value and src.scheme == "header" and len(value) < MIN_HEADER_SECRET_CHARS:
            r.fail(f"{key}.secret_env", f"environment variable {var}: a header secret needs "
                                        f"at least {MIN_HEADER_SECRET_CHARS} characters")
    if r.found_since(mark):
        return None
    return WebhookSource(name=name, config=src, secrets=secrets)


# The schemes whose sources say where the signature, id and event type are
_NAMING: Final = ("hmac-sha256", "header")
MIN_HEADER_SECRET_CHARS: Final = 16  # a static secret is all there is: not a guessable one


def _scheme_problems(key: str, src: WebhookSourceConfig, r: Resolution) -> None:
    """The headers and body path a source names, which only the hmac-sha256 and header
    schemes take (and the signature header they need)."""
    if src.scheme in _NAMING and not src.signature_header:
        r.fail(f"{key}.signature_header", f"required for scheme {src.scheme!r}")
    for option in ("signature_header", "id_header", "topic_header", "topic_path"):
        if src.scheme not in _NAMING and getattr(src, option) is not None:
            r.fail(f"{key}.{option}", f"only for schemes 'hmac-sha256' and 'header' (scheme "
                                      f"{src.scheme!r} names its own)")
    if src.topic_header is not None and src.topic_path is not None:
        r.fail(f"{key}.topic_path", "set topic_header or topic_path, not both")


def _standard_secret_ok(secret: str) -> bool:
    try:
        standard_key(secret)
    except ValueError:
        return False
    return True
