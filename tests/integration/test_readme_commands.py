"""The documentation's commands run as written: the README's local walkthrough and the
hosted-cron and runbook shell blocks of docs/operations.md are executed with bash, curl and
jq against a live server (`curl -f` and `pipefail` turn any 4xx/5xx into a failure); every
metric the README or docs/ names is one /metrics serves; every relative link resolves."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from service.config.policies import Policies
from tests.conftest import (
    REPO_ROOT,
    TOKEN_A,
    LiveServer,
    free_port,
    policies_from,
    test_settings,
)

# every test here starts processes (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
OPERATIONS = REPO_ROOT / "docs" / "operations.md"
CONFIGURATION = REPO_ROOT / "docs" / "configuration.md"
SCRIPT_TIMEOUT_S = 60
EXIT_WAIT_S = 10


def section(path: Path, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    text = path.read_text(encoding="utf-8")
    level = len(heading.split(" ")[0])
    lines = text[text.index(heading + "\n"):].splitlines()[1:]
    taken, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        taken.append(line)
    return "\n".join(taken) + "\n"


def shell_block_list(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def shell_blocks(text: str) -> str:
    return "\n".join(shell_block_list(text))


def json_documents(text: str) -> list[Any]:
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


@pytest.fixture
def policies() -> Policies:
    return policies_from({
        "upstreams": {"storefront": {"base_url": "http://127.0.0.1:9"}},
        "policies": {"cart-retention": {
            "version": 1, "upstream": "storefront", "scope": "tenant:{tenant_id}",
            "path": "/tenants/{tenant_id}/carts/{object_id}", "rate": {"per_second": 5}}}})


async def bash(script: str, env: dict[str, str], cwd: Path | None = None
               ) -> tuple[int, str, str]:
    """Run `script` with `bash -euo pipefail` in a session of its own; whatever it started
    in the background is stopped (SIGTERM, then SIGKILL) before this returns."""
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"the documentation's commands need {tool} on PATH"
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, env={"PATH": os.environ["PATH"], **env},
        cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=SCRIPT_TIMEOUT_S)
    finally:
        await _end_session(proc.pid)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _end_session(pgid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        for _ in range(int(EXIT_WAIT_S / 0.1)):
            await asyncio.sleep(0.1)
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return


async def test_first_configuration_walkthrough_works(db_url: str, tmp_path: Path) -> None:
    """docs/configuration.md's "A first configuration" block, on a free port and the
    test's database."""
    blocks = shell_block_list(section(CONFIGURATION, "## A first configuration"))
    walkthrough = next(b for b in blocks if "serve --api-only" in b)
    port = free_port()
    venv_bin = str(Path(sys.executable).parent) + "/"
    script = (walkthrough.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
              .replace(".venv/bin/", venv_bin))
    assert script.count(f"127.0.0.1:{port}") == 3 and script.count(venv_bin) == 3
    env = {"SWEEPER_DATABASE_URL": db_url, "SWEEPER_PORT": str(port),
           "SWEEPER_URL": f"http://127.0.0.1:{port}", "SWEEPER_DATA_DIR": str(tmp_path)}
    code, out, err = await bash(script, env, cwd=REPO_ROOT)
    assert code == 0, f"{err}\n{out}"
    assert '"status":"ready"' in out and '"inserted":1' in out
    assert json.loads(out[out.rindex("{\n"):]) == {
        "state": "published", "candidates": 1, "released": 0,
        "oldest_due_at": "2020-01-01T00:00:00Z"}


async def test_operations_commands_work(db_url: str, policies: Policies, tmp_path: Path
                                        ) -> None:
    cron = shell_blocks(section(OPERATIONS, "### Wire a hosted cron service"))
    runbook = shell_blocks(section(OPERATIONS, "## Runbook"))
    assert cron.count("curl ") == 2 and runbook.count("curl ") >= 12
    # every shell example of the operations guide is one of these
    assert shell_blocks(OPERATIONS.read_text(encoding="utf-8")) == cron + "\n" + runbook
    settings = test_settings(db_url, evidence_signing_key=base64.b64encode(bytes(32)).decode())
    async with LiveServer(settings, policies, db_url) as live:
        # the guide's `sweeper` is the one installed beside these tests
        env = {"SWEEPER_URL": live.base_url, "SWEEPER_TOKEN": TOKEN_A,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        async with live.client() as api:
            seeded = await api.post("/v1/items", json={"items": [
                {"tenant_id": "acme.myshopify.com", "object_id": f"cart-{n}",
                 "policy": "cart-retention", "due_at": "2020-01-01T00:00:00Z"}
                for n in range(3)]})
            assert seeded.status_code == 200, seeded.text

            code, out, err = await bash(cron, env)
            assert code == 0, err
            first, retry = json_documents(out)
            assert first["id"] == retry["id"]  # the slot's key: one run, however often sent

            code, out, err = await bash(runbook, env, cwd=tmp_path)
            assert code == 0, f"{err}\n{out}"
            assert re.search(r"verified: run \d+, 0 record\(s\), no entries, 0 checkpoint\(s\), "
                             r"signed with key", out), out
            assert re.search(r"log-0.jsonl: verified: log range, 0 record\(s\)", out), out

            runs = (await api.get("/v1/runs")).json()["runs"]
            assert [(r["dry_run"], r["tenant_id"], r["max_items"]) for r in runs[:2]] == [
                (False, "acme.myshopify.com", 100), (True, None, None)]
            scope = (await api.get("/v1/scopes")).json()["scopes"][0]
            assert (scope["name"], scope["rate_per_second"], scope["paused"]) == (
                "tenant:acme.myshopify.com", 10.0, False)
            assert (await api.get("/v1/workers")).json()["workers_paused"] is False
            metrics = (await api.get("/metrics")).text

    named = {(path.name, name) for path in (README, *DOCS)
             for name in re.findall(r"\bsweeper_[a-z_]+[a-z]\b", path.read_text("utf-8"))}
    assert {name for _, name in named} >= {"sweeper_completions_total",
                                           "sweeper_webhooks_total"}
    for where, name in sorted(named):
        assert re.search(rf"^# TYPE {name}(_total)? ", metrics, re.MULTILINE), (
            f"{where} names {name}, which /metrics does not serve")


# -- links ---------------------------------------------------------------------------

_FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """Markdown without code, where `[x](y)` is no link."""
    return _CODE_SPAN.sub("", _FENCED.sub("", text))


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub generates for a markdown file (`-1`, `-2` for repeats)."""
    found: set[str] = set()
    repeats: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _FENCED.sub("", path.read_text("utf-8")),
                              re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = repeats.get(slug, 0)
        repeats[slug] = n + 1
        found.add(f"{slug}-{n}" if n else slug)
    return found


@pytest.mark.parametrize("doc", [README, *DOCS, REPO_ROOT / "bench" / "README.md"],
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    targets = _LINK.findall(_prose(doc.read_text(encoding="utf-8")))
    assert targets, f"{doc} has no links (is the pattern still right?)"
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == [], f"{doc.relative_to(REPO_ROOT)}: {broken}"


def test_docs_folder_is_checked() -> None:
    assert {p.name for p in DOCS} >= {"architecture.md", "configuration.md", "http-api.md",
                                      "webhooks.md", "operations.md", "development.md"}
