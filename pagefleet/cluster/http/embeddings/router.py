"""The route of `/v1/embeddings` (`serving.py` does the work)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from ..gate import arrival
from .protocol import EmbeddingRequest, EmbeddingResponse
from .serving import EmbeddingServing

router = APIRouter()


def embeddings_of(request: Request) -> EmbeddingServing:
    return request.app.state.embeddings


EmbeddingsDep = Annotated[EmbeddingServing, Depends(embeddings_of)]


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create(req: EmbeddingRequest, embeddings: EmbeddingsDep, request: Request) -> Any:
    return await embeddings.create(req, arrival(request.scope))
