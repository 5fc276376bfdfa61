"""The contract as a client author uses it: a Python client generated from the committed
openapi/openapi.json by openapi-python-client, driving the seeded Sweeper
(tests/contract/seeded.py) through items, runs, holds, scopes and evidence. Optional bodies
are left out (no `body=None`), and every line of the JSON-lines evidence exports matches the
line schema the contract declares (`x-itemSchema`), read with the generated line models.

The one setting the generator is given: it reads `application/x-ndjson` as text (it reads
JSON, text/* and octet streams only), so an export arrives as a `str` of JSON lines."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from tests.conftest import TOKEN_A
from tests.contract.seeded import Seeded

pytestmark = pytest.mark.slow  # generates and imports a package

CONTRACT = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
PACKAGE = "sweeper_client"
TENANT = "client-co"
OBJECTS = [f"cart-ok-client-{i}" for i in range(3)]  # the fake upstream answers 204
PAST = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    out = tmp_path_factory.mktemp("generated")
    config = out / "config.yaml"
    config.write_text("content_type_overrides:\n  application/x-ndjson: text/plain\n")
    tools = Path(sys.executable).parent  # the generator formats its output with ruff
    result = subprocess.run(
        [str(tools / "openapi-python-client"), "generate", "--path", str(CONTRACT),
         "--meta", "none", "--output-path", str(out / PACKAGE), "--config", str(config)],
        capture_output=True, text=True, timeout=300, cwd=out,
        env={**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert result.returncode == 0, result.stdout + result.stderr
    # every operation and schema became code: nothing the generator skipped with a warning
    assert "WARNING" not in result.stdout, result.stdout
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))


def _api(generated: ModuleType, tag: str) -> Any:
    """The operations of one tag, each a module (`register_items.sync(...)`)."""
    package = importlib.import_module(f"{generated.__name__}.api.{tag}")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return package


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _line_validator() -> jsonschema.Draft202012Validator:
    document = json.loads(CONTRACT.read_text())
    registry = Registry().with_resource(
        "urn:sweeper", Resource.from_contents(document, default_specification=DRAFT202012))
    media = document["paths"]["/v1/evidence/log"]["get"]["responses"]["200"]["content"]
    ref = media["application/x-ndjson"]["x-itemSchema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": f"urn:sweeper{ref}"}, registry=registry)


def test_a_generated_client_drives_the_service(generated: ModuleType, sweeper: Seeded
                                               ) -> None:
    models = importlib.import_module(f"{PACKAGE}.models")
    items, runs = _api(generated, "items"), _api(generated, "runs")
    holds, scopes = _api(generated, "holds"), _api(generated, "scopes")
    evidence = _api(generated, "evidence")
    client = generated.AuthenticatedClient(base_url=sweeper.base_url, token=TOKEN_A)
    with client:
        later = datetime.now(UTC) + timedelta(days=30)  # not due: no run releases it
        registered = items.register_items.sync(client=client, body=models.ItemsIn(items=[
            *(models.ItemIn(tenant_id=TENANT, object_id=o, policy="carts", due_at=PAST)
              for o in OBJECTS),
            models.ItemIn(tenant_id=TENANT, object_id="cart-later-client", policy="carts",
                          due_at=later)]))
        assert isinstance(registered, models.RegistrationOut) and registered.inserted == 4
        # a run of this tenant; no optional field set
        run = runs.create_run.sync(client=client, body=models.RunIn(tenant_id=TENANT))
        assert isinstance(run, models.RunOut) and run.tenant_id == TENANT

        def deleted() -> bool:
            return all(evidence.get_evidence.sync(
                client=client, tenant_id=TENANT, object_id=o).deleted for o in OBJECTS)

        _until(deleted, "the run's items were never deleted")
        run = runs.get_run.sync(client=client, run_id=run.id)
        assert isinstance(run, models.RunOut) and run.state == "published"

        _read_exports(client, runs, evidence, models, run.id)
        _hold_and_release(client, holds, models)
        # a later item withdrawn before it ran
        cancelled = items.cancel_items.sync(client=client, body=models.ItemSelection(
            why="registered by mistake", tenant_id=TENANT, items=[models.ItemRef(
                tenant_id=TENANT, object_id="cart-later-client", policy="carts")]))
        assert isinstance(cancelled, models.ChangeOut) and cancelled.count == 1
        # optional bodies left out: the scope paused and resumed without a reason
        scope = f"tenant:{TENANT}"
        paused = scopes.pause_scope.sync(client=client, scope=scope)
        assert isinstance(paused, models.ScopeOut) and paused.paused
        resumed = scopes.resume_scope.sync(client=client, scope=scope)
        assert isinstance(resumed, models.ScopeOut) and not resumed.paused


def _read_exports(client: Any, runs: Any, evidence: Any, models: ModuleType, run_id: int
                  ) -> None:
    """The run's export and the log's first page: every line is an EvidenceLine; the run's
    entries are its three deletions."""
    validator = _line_validator()
    exported = runs.get_run_evidence.sync(client=client, run_id=run_id)
    assert isinstance(exported, str)
    lines = [json.loads(line) for line in exported.splitlines()]
    for line in lines:
        validator.validate(line)
    entries = [models.EntryLine.from_dict(line) for line in lines if "object_id" in line]
    assert sorted(e.object_id for e in entries) == OBJECTS
    assert {e.outcome for e in entries} == {"succeeded"} and {e.run_id for e in entries} == {
        run_id}
    manifest = models.ManifestLine.from_dict(lines[-1])
    assert manifest.manifest.run_id == run_id and manifest.manifest.records == len(OBJECTS)
    page = evidence.get_evidence_log.sync(client=client, after=0, limit=1000)
    assert isinstance(page, str)
    for line in page.splitlines():
        validator.validate(json.loads(line))


def _hold_and_release(client: Any, holds: Any, models: ModuleType) -> None:
    placed = holds.place_hold.sync(client=client, body=models.HoldIn(
        tenant_id=TENANT, reason="litigation hold: order dispute", reference="CASE-2291",
        object_id_prefix="cart-later-", expires_at=datetime.now(UTC) + timedelta(days=1)))
    assert isinstance(placed, models.HoldOut) and placed.active
    fetched = holds.get_hold.sync(client=client, hold_id=placed.id)
    assert isinstance(fetched, models.HoldOut) and fetched.reference == "CASE-2291"
    listed = holds.list_holds.sync(client=client, tenant_id=TENANT)
    assert isinstance(listed, models.HoldPage) and placed.id in [h.id for h in listed.holds]
    released = holds.release_hold.sync(client=client, hold_id=placed.id,
                                       body=models.ReleaseIn(why="case settled"))
    assert isinstance(released, models.ReleasedOut) and not released.active
