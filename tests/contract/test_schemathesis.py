"""Schemathesis over the whole OpenAPI contract (the committed openapi/openapi.json, which
another test keeps equal to the app's), against Sweeper as deployed: a uvicorn server on
loopback whose worker pool is calling a fake upstream, over a ledger seeded through the API
with every status and scope state (tests/contract/seeded.py). Every check schemathesis has
is on; the only widening is in schemathesis.toml, with its reason.

- one test per operation: the examples, coverage and fuzzing phases, valid and invalid
  inputs; webhook deliveries go to a configured source, signed over the exact bytes sent
  (tests/contract/hooks.py), so they reach the mapping and the ledger
- one stateful test: Hypothesis chains calls along the contract's OpenAPI links
  (service/http/api/links.py), e.g. a run it created, then that run's status and evidence
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis.config import SchemathesisConfig

from service.http.api.links import LINKS
from tests.contract import hooks  # noqa: F401 - registers the auth and signing hooks
from tests.contract.seeded import SOURCE, Seeded

# every test here fuzzes a live server for seconds (see the marker in pyproject.toml)
pytestmark = pytest.mark.slow

CONTRACT = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
CONFIG = SchemathesisConfig.from_path(Path(__file__).with_name("schemathesis.toml"))
# stateful: scenarios, and calls per scenario
SCENARIOS = 100
STEPS = 10

schema = schemathesis.openapi.from_path(CONTRACT, config=CONFIG)


def test_the_fuzzing_meets_a_working_ledger(sweeper: Seeded) -> None:
    """What the fuzzing starts from is what production answers hold: the worker pool ran in
    the server's lifespan (only it calls the upstream) and left every item status, a retried
    item, an unreleased one, a closed and a paused scope."""
    assert {c.path for c in sweeper.upstream.calls()} >= {"/carts/cart-ok-0", "/carts/4242"}
    seed = sweeper.seed
    assert {"pending", "succeeded", "dead", "cancelled"} <= set(seed.statuses)
    assert seed.retried and seed.unreleased
    assert "tenant:globex" in seed.closed_scopes and "tenant:initech" in seed.paused_scopes


def test_a_case_sent_to_the_source_is_signed_and_applied(sweeper: Seeded) -> None:
    """The signing hook gets deliveries past the signature check into the rules and the
    ledger (an unsigned one would answer 401)."""
    case = schema.make_case(operation=schema["/v1/webhooks/{source}"]["POST"],
                            path_parameters={"source": SOURCE}, media_type="application/json",
                            body={"id": "contract-ünï 4243", "cancel_reason": "customer"})
    response = case.call(base_url=sweeper.base_url)
    assert response.status_code == 202, response.text
    assert response.json()["result"] == "applied" and response.json()["item_ids"]


@schema.parametrize()
@hypothesis.settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_operation_honours_the_contract(case: Any, sweeper: Seeded) -> None:
    case.call_and_validate(base_url=sweeper.base_url)


def test_every_declared_link_is_a_transition() -> None:
    """Schemathesis reads every link the app declares; none is dropped (a fresh load: the
    stateful test adds links it infers to the schema it runs on)."""
    fresh = schemathesis.openapi.from_path(CONTRACT, config=CONFIG)
    assert fresh.statistic.transitions.total == sum(len(links) for links in LINKS.values())


def test_linked_calls_honour_the_contract(sweeper: Seeded) -> None:
    failures: list[str] = []

    class LinkedCalls(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": sweeper.base_url}

        def validate_response(self, response: Any, case: Any, *args: Any, **kwargs: Any
                              ) -> None:
            try:
                super().validate_response(response, case, *args, **kwargs)
            except Exception as exc:
                failures.append(f"{case.operation.label}: {exc}")
                raise

    try:
        LinkedCalls.run(settings=hypothesis.settings(
            max_examples=SCENARIOS, stateful_step_count=STEPS, deadline=None, database=None,
            suppress_health_check=list(HealthCheck)))
    except hypothesis.errors.Flaky:
        # The ledger is live (workers drain it, scopes close and reopen), so a scenario
        # Hypothesis replays may find other answers and draw other steps. As schemathesis'
        # own runner does, that is a pass unless some check failed.
        assert not failures, failures
