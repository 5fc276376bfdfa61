"""`/metrics`: the Prometheus text format, or OpenMetrics when the scraper's Accept header
asks for it."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS

from service.http.api.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get("/metrics", operation_id="metrics", response_class=Response,
            responses={200: {"content": {"text/plain; version=0.0.4; charset=utf-8": {},
                                         OPENMETRICS: {}},
                             "description": "Prometheus text exposition format, or "
                                            "OpenMetrics when the Accept header asks for it"}})
async def metrics(runtime: RuntimeDep, request: Request) -> Response:
    """Per-process counters and histograms, plus ledger-wide gauges read from the database
    (cached for a few seconds; every replica reports the same values)."""
    # read, not declared: Accept negotiates the format and is no parameter of the operation
    exposition = await runtime.exporter.render(request.headers.get("accept", ""))
    return Response(exposition.body, media_type=exposition.content_type)
