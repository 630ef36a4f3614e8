"""`GET /v1/models`: the one model this fleet serves."""

from __future__ import annotations

from fastapi import APIRouter

from .response_models import ModelCard, ModelList
from .state import ServingDep

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(serving: ServingDep) -> ModelList:
    info = await serving.info()
    name = serving.model_name
    return ModelList(data=[ModelCard(id=name, root=name, max_model_len=info.max_model_len)])
