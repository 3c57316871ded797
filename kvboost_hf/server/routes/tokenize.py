"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``.

lm-eval's ``local-completions`` probes ``/tokenizer_info`` and ``/tokenize`` and, when both answer,
tokenizes through the server (its "remote" tokenizer backend) instead of loading one itself.
Shapes: ``/tokenize`` ``{"prompt" | "messages", "add_special_tokens"}`` ->
``{"tokens", "count", "max_model_len"}``; ``/detokenize`` ``{"tokens"}`` -> ``{"prompt"}``.
``/tokenizer_info`` also says ``add_bos_token``: whether the tokenizer puts ``bos_token`` before
every text. lm-eval's remote tokenizer always asks ``/tokenize`` for no special tokens, so its
prompts lack a ``<bos>`` such a model needs (see :mod:`kvboost_hf.server.decoding.bos` and docs/server.md's lm-eval command).
They take the API key and the body-size limit as the ``/v1`` routes do (the app's middleware).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from kvboost_hf.server.api import requests as schemas
from kvboost_hf.server.api.errors import APIError


def install_tokenizer_routes(app: FastAPI, service) -> None:
    """Add the three routes to ``app``, answering with ``service``'s tokenizer and model."""
    tokenizer = service.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: schemas.TokenizeRequest) -> dict:
        if body.model is not None:
            service.check_model_name(body.model)
        if body.messages is not None:
            tokens = await service.chat_prompt(body.messages, add_generation_prompt=body.add_generation_prompt)
        else:
            encoded = await run_in_threadpool(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
            tokens = list(encoded["input_ids"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": service.context}

    @app.post("/detokenize")
    async def detokenize(body: schemas.DetokenizeRequest) -> dict:
        if body.model is not None:
            service.check_model_name(body.model)
        bad = [t for t in body.tokens if not 0 <= t < service.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {service.vocab_size}); got {bad[:5]}", param="tokens",
                           code="invalid_value")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "add_bos_token": service.bos.bos_id is not None,  # the tokenizer puts bos_token before every text
            "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": service.context,
            "vocab_size": service.vocab_size,
        }
