"""The operator's endpoints: `GET /health`, `GET /version`, `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagefleet

from ..metrics import exposition
from .errors import error_response
from .state import ServingDep

router = APIRouter()


@router.get("/health")
async def health(serving: ServingDep) -> Response:
    if await serving.backend.healthy():
        return Response(status_code=200)
    return error_response(503, "no healthy engine replica")


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": pagefleet.__version__}


@router.get("/metrics")
async def metrics(serving: ServingDep) -> Response:
    families = await serving.backend.metric_snapshots()
    return Response(exposition(families), media_type=CONTENT_TYPE_LATEST)
