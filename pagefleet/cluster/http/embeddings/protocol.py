"""`/v1/embeddings` bodies, as OpenAI's (vLLM's extras refused by name in `serving.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..protocol import RequestModel


class EmbeddingRequest(RequestModel):
    model: str | None = Field(None, description="the served model's name (default: it)")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector"
    )
    dimensions: int | None = Field(None, description="refused: vectors have the model's width")
    user: str | None = None
    add_special_tokens: bool = Field(True, description="vLLM's: when tokenizing strings")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
