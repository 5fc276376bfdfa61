"""`/metrics` in the Prometheus text format."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/metrics", operation_id="metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}},
                             "description": "Prometheus text exposition format"}})
async def metrics(runtime: RuntimeDep) -> Response:
    """Per-process counters and histograms, plus ledger-wide gauges read from the database
    (cached for a few seconds; every replica reports the same values)."""
    return Response(await runtime.exporter.render(), media_type=CONTENT_TYPE_LATEST)
