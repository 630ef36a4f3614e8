"""`POST /tokenize` and `POST /detokenize` (vLLM's extras)."""

from __future__ import annotations

from fastapi import APIRouter

from .protocol import DetokenizeRequest, TokenizeRequest
from .response_models import DetokenizeResponse, TokenizeResponse
from .state import ServingDep
from .tokenizer import TemplateInputs

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, serving: ServingDep) -> TokenizeResponse:
    serving.check_model(req.model)
    tok = serving.tokenizer
    if req.messages is not None:
        text = await tok.chat_prompt(req.messages, TemplateInputs(req.add_generation_prompt))
        ids = await tok.encode(text, add_special_tokens=False)
    else:  # the model requires one of the two
        ids = await tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    info = await serving.info()
    return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, serving: ServingDep) -> DetokenizeResponse:
    serving.check_model(req.model)
    await serving.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(prompt=await serving.tokenizer.decode(req.tokens))
