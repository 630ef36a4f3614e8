"""The routes of `/v1/responses`: create, retrieve, delete (`serving.py` does the work)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request

from .protocol import ResponsesRequest
from .serving import ResponsesServing, owner_of

router = APIRouter()


def responses_of(request: Request) -> ResponsesServing:
    return request.app.state.responses


ResponsesDep = Annotated[ResponsesServing, Depends(responses_of)]
Authorization = Annotated[str | None, Header()]


@router.post("/v1/responses")
async def create(
    req: ResponsesRequest, responses: ResponsesDep, authorization: Authorization = None
) -> Any:
    arrived = asyncio.get_running_loop().time()
    return await responses.create(req, owner_of(authorization), arrived)


@router.get("/v1/responses/{response_id}")
async def retrieve(
    response_id: str, responses: ResponsesDep, authorization: Authorization = None
) -> dict[str, Any]:
    return await responses.retrieve(owner_of(authorization), response_id)


@router.delete("/v1/responses/{response_id}")
async def delete(
    response_id: str, responses: ResponsesDep, authorization: Authorization = None
) -> dict[str, Any]:
    return await responses.delete(owner_of(authorization), response_id)
