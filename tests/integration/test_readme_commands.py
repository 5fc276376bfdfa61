"""The README's operator commands run as written: the hosted-cron and runbook shell blocks
are executed with bash, curl and jq against a live server (`curl -f` and `pipefail` turn
any 4xx/5xx into a failure), and every metric the README names is one /metrics serves."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from typing import Any

import httpx
import pytest

from service.policies import Policies
from tests.conftest import REPO_ROOT, TOKEN_A, LiveServer, policies_from, test_settings

README = (REPO_ROOT / "README.md").read_text(encoding="utf-8")


def section(heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = len(heading.split(" ")[0])
    lines = README[README.index(heading + "\n"):].splitlines()[1:]
    taken, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        taken.append(line)
    return "\n".join(taken) + "\n"


def shell_blocks(text: str) -> str:
    return "\n".join(re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL))


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


async def bash(script: str, base_url: str) -> tuple[int, str, str]:
    for tool in ("bash", "curl", "jq"):
        assert shutil.which(tool), f"the README's commands need {tool} on PATH"
    env = {"PATH": os.environ["PATH"], "SWEEPER_URL": base_url, "SWEEPER_TOKEN": TOKEN_A}
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_readme_operator_commands_work(db_url: str, policies: Policies) -> None:
    cron = shell_blocks(section("### Wire a hosted cron service"))
    runbook = shell_blocks(section("## Runbook"))
    assert cron.count("curl ") == 2 and runbook.count("curl ") >= 12
    async with LiveServer(test_settings(db_url), policies, db_url) as live:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=10, headers={
                "Authorization": f"Bearer {TOKEN_A}"}) as api:
            seeded = await api.post("/v1/items", json={"items": [
                {"tenant_id": "acme.myshopify.com", "object_id": f"cart-{n}",
                 "policy": "cart-retention", "due_at": "2020-01-01T00:00:00Z"}
                for n in range(3)]})
            assert seeded.status_code == 200, seeded.text

            code, out, err = await bash(cron, live.base_url)
            assert code == 0, err
            first, retry = json_documents(out)
            assert first["id"] == retry["id"]  # the slot's key: one run, however often sent

            code, out, err = await bash(runbook, live.base_url)
            assert code == 0, f"{err}\n{out}"

            runs = (await api.get("/v1/runs")).json()["runs"]
            assert [(r["dry_run"], r["tenant_id"], r["max_items"]) for r in runs[:2]] == [
                (False, "acme.myshopify.com", 100), (True, None, None)]
            scope = (await api.get("/v1/scopes")).json()["scopes"][0]
            assert (scope["name"], scope["rate_per_second"], scope["paused"]) == (
                "tenant:acme.myshopify.com", 10.0, False)
            assert (await api.get("/v1/workers")).json()["workers_paused"] is False
            metrics = (await api.get("/metrics")).text

    named = set(re.findall(r"\bsweeper_[a-z_]+[a-z]\b", README))
    assert named
    for name in sorted(named):
        assert re.search(rf"^# TYPE {name}(_total)? ", metrics, re.MULTILINE), (
            f"the README names {name}, which /metrics does not serve")
