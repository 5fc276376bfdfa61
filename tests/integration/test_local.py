"""`sweeper local` and the README's three commands: the newcomer's first deletion, run as
written against a real `sweeper local` process (its embedded database, its simulated store
over loopback)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.commands.exits import Exit
from service.commands.local import LOCAL_TOKEN, signing_key, try_commands
from service.config.settings import Settings
from service.config.signing_keys import LOCAL_KEY_FILE
from tests.conftest import REPO_ROOT, free_port
from tests.integration.test_readme_commands import bash, section, shell_block_list

README = REPO_ROOT / "README.md"


def readme_commands() -> str:
    blocks = shell_block_list(section(README, "## Try it locally"))
    return next(b for b in blocks if b.startswith("curl "))


def test_the_readme_shows_the_commands_sweeper_local_prints() -> None:
    assert readme_commands() == try_commands(8080)
    assert f"`{LOCAL_TOKEN}`" in section(README, "## Try it locally")


def test_local_and_demo_sign_with_a_key_kept_beside_their_database(tmp_path: Path) -> None:
    """`local` made a new signing key on every start, even with --data-dir, so the exports
    of earlier starts no longer verified under the key it published; `demo` had none. A
    kept database keeps its key beside it; a temporary one has a key of its own."""
    key, path = signing_key(tmp_path)
    assert key is None and path == tmp_path / LOCAL_KEY_FILE
    made = path.read_bytes()
    assert signing_key(tmp_path) == (None, path) and path.read_bytes() == made
    assert Settings(evidence_signing_key_file=path).evidence_signer() is not None
    first, second = signing_key(None), signing_key(None)
    assert first[1] is None and first[0] is not None and second[0] is not None
    assert first[0].get_secret_value() != second[0].get_secret_value()


@pytest.mark.slow
async def test_first_deletion_with_the_readme_commands(tmp_path: Path) -> None:
    port, store_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWEEPER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "local", "--port", str(port), "--store-port",
         str(store_port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "sweeper local did not get ready in 60 s"
            time.sleep(0.2)

        register, trigger, status = (readme_commands().replace(
            "127.0.0.1:8080", f"127.0.0.1:{port}").split("\ncurl "))
        code, out, err = await bash(register, {})
        assert code == 0, err
        assert json.loads(out) == {"inserted": 3, "advanced": 0, "unchanged": 0}
        code, out, err = await bash("curl " + trigger, {})
        assert code == 0, err
        assert json.loads(out)["id"] == 1

        for _ in range(100):  # the reader's "a second later"
            code, out, err = await bash("curl " + status, {})
            assert code == 0, err
            run, *lines, manifest = [json.loads(line) for line in out.splitlines() if line]
            evidence = [line for line in lines if "item_id" in line]  # not the checkpoints
            if run["items"] == {"succeeded": 3}:
                break
            time.sleep(0.1)
        assert run["items"] == {"succeeded": 3}, run
        assert sorted((e["tenant_id"], e["object_id"], e["upstream_status"])
                      for e in evidence) == [("shop-1.example", "cart-1", 204),
                                             ("shop-1.example", "cart-2", 204),
                                             ("shop-2.example", "cart-3", 204)]
        assert len({e["operation_key"] for e in evidence}) == 3
        assert manifest["manifest"]["records"] == 3 and manifest["signature"]
        store = httpx.get(f"http://127.0.0.1:{store_port}/").json()
        assert (store["deleted"], store["throttled"]) == (3, 0)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == Exit.OK, err
    assert "Traceback" not in err
    assert f"bearer token {LOCAL_TOKEN}" in out
    # the temporary database is gone once it stops
    folder = re.search(r"host=(%2F[^ .]+)", out)
    assert folder is not None, out
    assert not Path(folder.group(1).replace("%2F", "/")).parent.exists()
