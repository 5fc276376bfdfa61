"""`sweeper openapi`: the checked-in OpenAPI contract (openapi/openapi.json), rendered from
the app, sorted, stable; written, or with --check compared with the file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from service.commands.exits import Exit
from service.config.policies import Policies
from service.config.settings import Settings, async_url


def openapi_document() -> dict[str, object]:
    """The OpenAPI document of an app built with default settings (nothing connects)."""
    from service.app import create_app  # here: the other commands never load the app

    app = create_app(Settings.model_construct(), Policies.empty(),
                     async_url("postgresql://localhost/sweeper"))
    return app.openapi()


def render_openapi() -> str:
    """The document as the JSON text written to openapi/openapi.json."""
    return json.dumps(openapi_document(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def cmd_openapi(args: argparse.Namespace) -> int:
    """Write the document to --output, or with --check exit 1 if the file differs."""
    document = render_openapi()
    out: Path = args.output
    if args.check:
        current = out.read_text(encoding="utf-8") if out.exists() else ""
        if current != document:
            print(f"{out} is out of date; run `sweeper openapi`", file=sys.stderr)
            return Exit.INCOMPLETE
        print(f"{out} is up to date")
        return Exit.OK
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(document, encoding="utf-8")
    print(f"wrote {out}")
    return Exit.OK
