"""Each app's /metrics exporter (service/ledger/gauges.py): the process's series and its own
ledger's figures, in a registry of its own; nothing of an app's ledger is registered
process-wide, so the many apps of one test process never see each other's."""

from __future__ import annotations

from prometheus_client import generate_latest

from service.ledger.gauges import Exporter, LedgerCollector
from service.observability.metrics import REGISTRY


def exposition(exporter: Exporter) -> str:
    return generate_latest(exporter.registry).decode()


def test_each_app_serves_its_own_ledger_beside_the_process_series() -> None:
    # no engine: collect() renders the last snapshot and never reads the database
    first = Exporter(LedgerCollector(engine=None, policies=["carts"]))  # type: ignore[arg-type]
    second = Exporter(LedgerCollector(engine=None, policies=["orders"]))  # type: ignore[arg-type]
    assert 'sweeper_items_eligible{policy="carts"} 0.0' in exposition(first)
    assert 'policy="orders"' not in exposition(first)
    assert 'sweeper_items_eligible{policy="orders"} 0.0' in exposition(second)
    for exporter in (first, second):
        assert "sweeper_build_info" in exposition(exporter)  # the process's own series
    assert "sweeper_ledger_up" not in generate_latest(REGISTRY).decode()
