"""`sweeper run`: trigger a run on a server and, with --follow, show its progress live
and exit by how it ended (service/commands/exits.py): 0 drained with no dead item (or nothing was
due), 1 some items went dead, 6 the run failed, 5 the server was unreachable or refused."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import httpx

from service.commands.exits import Exit
from service.errors import ConfigError, SweeperError

TERMINAL = ("succeeded", "dead", "cancelled", "skipped")
POLL_INTERVAL_S = 0.5
PLAIN_REPORT_EVERY_S = 5.0
BAR_WIDTH = 30  # characters, when the line fits
MIN_BAR_WIDTH = 10  # characters: narrower, a bar shows too little to be worth its room
MAX_ERRORS_SHOWN = 10


class RunFailed(SweeperError):
    """The server refused the trigger or could not be reached."""


@dataclass
class Progress:
    """Done/total with a rate measured over the follow so far."""

    started: float
    first_done: int | None = None

    def line(self, run: dict[str, Any], now: float, width: int | None = None) -> str:
        """The progress line; within `width` characters when given (a terminal's row): the
        bar narrows first, then the attempts lose their label, then their least frequent
        outcomes (an ellipsis says so); the counts, rate and ETA stay whole."""
        items: dict[str, int] = run.get("items", {})
        total = int(run.get("released", 0))
        done = sum(items.get(s, 0) for s in TERMINAL)
        if self.first_done is None:
            self.first_done = done
        elapsed = max(now - self.started, 1e-9)
        rate = (done - self.first_done) / elapsed
        publishing = run.get("state") == "publishing"
        share = done / total if total else (0.0 if publishing else 1.0)
        eta = f"{(total - done) / rate:.0f}s" if rate > 0 and done < total else "-"
        state = "" if run.get("state") == "published" else f" ({run.get('state')})"
        figures = f"{done}/{total} {share:4.0%} {rate:7.1f}/s ETA {eta}{state}"
        # the most frequent outcomes first: the last ones give way to a narrow row
        outcomes = [f"{k}={v}" for k, v in sorted(run.get("attempts", {}).items(),
                                                  key=lambda kv: (-kv[1], kv[0]))]
        bar, label, shown = BAR_WIDTH, "attempts: ", len(outcomes)

        def drawn() -> str:
            filled = int(bar * share)
            counts = " ".join(outcomes[:shown] + (["…"] if shown < len(outcomes) else []))
            return (f"[{'#' * filled}{'.' * (bar - filled)}] {figures}  "
                    f"{label}{counts or '-'}")

        while width is not None and len(drawn()) > width:
            if bar > MIN_BAR_WIDTH:
                bar = max(MIN_BAR_WIDTH, bar - (len(drawn()) - width))
            elif label:
                label = ""
            elif shown:
                shown -= 1
            else:
                return drawn()[:width]
        return drawn()


def finished(run: dict[str, Any]) -> bool:
    """Published, and none of its items pending or leased any more."""
    items = run.get("items", {})
    return bool(run.get("state") == "published" and not items.get("pending")
                and not items.get("leased"))


async def trigger(client: httpx.AsyncClient, body: dict[str, Any], key: str | None
                  ) -> dict[str, Any]:
    """POST /v1/runs and return the run."""
    headers = {"Idempotency-Key": key} if key else {}
    try:
        response = await client.post("/v1/runs", json=body, headers=headers)
    except httpx.TransportError as exc:
        raise RunFailed(f"cannot reach {client.base_url}: {type(exc).__name__}") from None
    if response.status_code not in (200, 202):
        raise RunFailed(_problem_text(response))
    run: dict[str, Any] = response.json()
    return run


async def follow(client: httpx.AsyncClient, run_id: int, out: TextIO = sys.stderr
                 ) -> dict[str, Any]:
    """Poll the run until it drains or fails, drawing a progress bar (a line every few
    seconds when `out` is not a terminal). Returns the final run."""
    progress = Progress(started=time.monotonic())
    tty = out.isatty()
    last_plain = 0.0
    while True:
        response = await client.get(f"/v1/runs/{run_id}")
        if response.status_code != 200:
            raise RunFailed(_problem_text(response))
        run: dict[str, Any] = response.json()
        now = time.monotonic()
        # one terminal row: `\r` returns to the start of the last row only, so a wrapped
        # line would leave an older bar above newer counts (the last column left free: some
        # terminals wrap on writing it)
        width = max(shutil.get_terminal_size().columns - 1, 1) if tty else None
        line = progress.line(run, now, width)
        done = finished(run)
        if tty:
            out.write("\r\x1b[2K" + line)
        elif done or now - last_plain >= PLAIN_REPORT_EVERY_S:
            out.write(line + "\n")
            last_plain = now
        out.flush()
        if done or run.get("state") == "failed":
            if tty:
                out.write("\n")
            return run
        await asyncio.sleep(POLL_INTERVAL_S)


def _problem_text(response: httpx.Response) -> str:
    """The refusal's status, title and detail, and for a 422 what was wrong where (a
    `--policy` naming no policy, say): "1 problem(s) in the request" alone says nothing."""
    try:
        doc = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    if not isinstance(doc, dict):
        return f"HTTP {response.status_code}"
    text = f"HTTP {response.status_code}: {doc.get('title')}: {doc.get('detail', '')}"
    errors = doc.get("errors")
    for error in errors[:MAX_ERRORS_SHOWN] if isinstance(errors, list) else ():
        if isinstance(error, dict):
            where = ".".join(str(part) for part in error.get("loc", ()))
            text += f"\n  {where}: {error.get('message', '')}"
    return text


def outcome(run: dict[str, Any]) -> tuple[Exit, str]:
    """How a followed run ended: the exit code and the line that says so."""
    name = f"run {run['id']}"
    if run.get("state") == "failed":
        error = run.get("report", {}).get("error") or {}
        return Exit.RUN_FAILED, f"{name} failed: {error.get('code')}: {error.get('message')}"
    if run["dry_run"]:
        return Exit.OK, (f"{name} (report only): {run['candidates']} candidate(s), oldest due "
                         f"{run['oldest_due_at'] or '-'}; nothing released")
    if not run.get("released"):
        return Exit.OK, f"{name}: nothing was due by the cutoff {run['cutoff']}; no item released"
    items = run.get("items", {})
    drained = f"{name} drained: " + ", ".join(f"{k}={v}" for k, v in sorted(items.items()))
    if items.get("dead"):
        return Exit.INCOMPLETE, (f"{drained}; {items['dead']} item(s) went dead "
                                 "(GET /v1/items?status=dead shows why)")
    return Exit.OK, drained


def goes_on(url: str, run_id: int, key: str | None) -> str:
    """What an interrupted `--follow` leaves: the run, going on on the server, and how to
    see it again."""
    again = (f"; the same command follows it again (Idempotency-Key {key!r}: the same run)"
             if key else "")
    return (f"run {run_id} goes on on the server; GET {url.rstrip('/')}/v1/runs/{run_id} "
            f"shows its progress{again}")


async def run_command(url: str, token: str | None, body: dict[str, Any], key: str | None,
                      follow_run: bool) -> int:
    """The `sweeper run` command body; prints the run id, then follows if asked and exits
    by how the run ended."""
    if not token:
        raise ConfigError("SWEEPER_TOKEN (or --token) is required to call the API")
    async with httpx.AsyncClient(base_url=url, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        run = await trigger(client, body, key)
        print(f"run {run['id']}: cutoff {run['cutoff']}, state {run['state']}"
              f"{' (dry run)' if run['dry_run'] else ''}")
        if not follow_run:
            return Exit.OK
        try:
            final = await follow(client, int(run["id"]))
        except asyncio.CancelledError:  # Ctrl-C (then exit 130): only the following stops
            below_bar = "\n" if sys.stderr.isatty() else ""
            print(f"{below_bar}sweeper: interrupted: {goes_on(url, int(run['id']), key)}",
                  file=sys.stderr)
            raise
    code, line = outcome(final)
    print(line, file=sys.stdout if code is Exit.OK else sys.stderr)
    return code


def cmd_run(args: argparse.Namespace) -> int:
    """`sweeper run`: the trigger's body from the options, the token from --token or
    SWEEPER_TOKEN."""
    body = {k: v for k, v in {"policy": args.policy, "tenant_id": args.tenant,
                              "dry_run": args.dry_run, "max_items": args.max_items}.items()
            if v not in (None, False)}
    token = args.token or os.environ.get("SWEEPER_TOKEN")
    return asyncio.run(run_command(args.url, token, body, args.idempotency_key, args.follow))
