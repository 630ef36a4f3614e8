"""What `/v1/embeddings` does: each input becomes one embedding request on the engines.

An input is validated and tokenized like a completion's prompt, then sent through the
same `Serving.start` (so the same router and engine replicas) with
`SamplingParams(embed=True)`: the engine runs its prefill only and answers its final
hidden states, pooled as its `pooling` setting says and L2-normalized, in the
finishing delta. `base64` is each vector's little-endian float32 bytes (OpenAI's).
`dimensions` is refused by name: a vector has the model's hidden size.
"""

from __future__ import annotations

import base64
import struct
import uuid

from pagefleet.engine import SamplingParams

from ..errors import APIError, to_api_error
from ..fields import Refused, refuse_unsupported
from ..serving import Prepared, Serving
from .protocol import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage

_INPUT_FORMS = "input must be a non-empty string, list of strings, token ids or token-id lists"
EMBEDDING_FIELDS: dict[str, Refused] = {
    "truncate_prompt_tokens": Refused("inputs are never truncated", (None,)),
    "normalize": Refused("vectors are always L2-normalized", (None, True)),
    "embed_dtype": Refused("vectors are float32", (None, "float32")),
}


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingServing:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: EmbeddingRequest, arrived: float) -> EmbeddingResponse:
        prep = await self.serving.in_time(arrived, self.prepare(req))
        vectors = await self._vectors(prep, arrived)
        if len(vectors) != len(prep.prompts):
            raise APIError(500, "the engine ended an embedding request without its vector")
        return EmbeddingResponse(
            data=[
                Embedding(index=i, embedding=encoded(vectors[i], req.encoding_format))
                for i in range(len(prep.prompts))
            ],
            model=self.serving.model_name,
            usage=self.usage(prep),
        )

    async def _vectors(self, prep: Prepared, arrived: float) -> dict[int, list[float]]:
        """Each input's vector, by input index, once its engine request finished."""
        deltas = self.serving.start(prep, f"embd-{uuid.uuid4().hex}", arrived)
        await deltas.admit()
        vectors: dict[int, list[float]] = {}
        try:
            async for i, d in deltas:
                if d.embedding is not None:
                    vectors[i] = d.embedding
        except Exception as e:
            raise to_api_error(e) from None
        finally:
            await deltas.aclose()
        return vectors

    @staticmethod
    def usage(prep: Prepared) -> EmbeddingUsage:
        tokens = sum(len(ids) for ids in prep.prompts)
        return EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)

    async def prepare(self, req: EmbeddingRequest) -> Prepared:
        self.serving.check_model(req.model)
        refuse_unsupported(req.model_extra, EMBEDDING_FIELDS)
        if req.dimensions is not None:
            raise APIError(
                400,
                "dimensions is not supported: a vector has the model's hidden size",
                "dimensions",
            )
        prompts, texts = await self._inputs(req)
        for ids in prompts:
            await self._check(ids)
        params = [SamplingParams(max_tokens=1, embed=True)] * len(prompts)
        return Prepared(prompts, texts, params, stream=False)

    async def _inputs(self, req: EmbeddingRequest) -> tuple[list[list[int]], list[str | None]]:
        x = req.input
        if isinstance(x, str):
            x = [x]
        if not x:
            raise APIError(400, _INPUT_FORMS, "input")
        if len(x) > self.serving.limits.max_prompts and not isinstance(x[0], int):
            raise APIError(
                400,
                f"{len(x)} inputs exceed the limit of {self.serving.limits.max_prompts} "
                "per request",
                "input",
            )
        if isinstance(x[0], str):
            texts: list[str] = x  # type: ignore[assignment]
            ids = await self.serving.tokenizer.encode_all(texts, req.add_special_tokens)
            return ids, list(texts)
        if isinstance(x[0], int):
            return [list(x)], [None]  # type: ignore[arg-type]
        return [list(p) for p in x], [None] * len(x)  # type: ignore[union-attr]

    async def _check(self, ids: list[int]) -> None:
        info = await self.serving.info()
        if not ids:
            raise APIError(400, _INPUT_FORMS, "input")
        if any(t < 0 or t >= info.vocab_size for t in ids):
            raise APIError(
                400, f"input token ids must be integers in [0, {info.vocab_size})", "input"
            )
        limit = info.max_model_len - 1
        cap = self.serving.limits.max_prompt_tokens
        if cap is not None:
            limit = min(limit, cap)
        if len(ids) > limit:
            raise APIError(
                400,
                f"an input has {len(ids)} tokens, more than the {limit} this model takes "
                f"(max_model_len {info.max_model_len})",
                "input",
            )
