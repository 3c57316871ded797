"""The OpenAI-compatible FastAPI app: ``create_app(model, tokenizer, store, settings)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``POST /v1/warm``, ``GET /v1/stats``, ``DELETE /v1/cache``, ``GET /health``,
``GET /metrics``, and vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``. The
``/v1`` and tokenizer routes take the API key (when one is set, or one of ``--api-keys``: tenants,
:mod:`.tenancy`) and a bounded request body (413 past ``max_body_bytes``).
Every request is checked (parameters, prompt length) before it is queued; generation runs as
rows of the continuous batch (:class:`~kvboost_hf.server.scheduling.batch.BatchingQueue`, the CLI's
default) or on the worker threads of :class:`~kvboost_hf.server.scheduling.workers.GenerationQueue`
(``--scheduler workers``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from kvboost_hf.generation import disable_chunk_reuse, enable_chunk_reuse
from kvboost_hf.server.api import requests as schemas
from kvboost_hf.server.api.errors import APIError, install_error_handlers
from kvboost_hf.server.api.keys import KeyRing, bearer_token
from kvboost_hf.server.observability.metrics import ServerMetrics
from kvboost_hf.server.observability.store_metrics import RemoteStoreCollector
from kvboost_hf.server.observability.streaming_metrics import StreamingCollector, streaming_snapshot
from kvboost_hf.server.routes.service import Service, context_length
from kvboost_hf.server.routes.tenancy import Tenancy
from kvboost_hf.server.routes.tokenize import install_tokenizer_routes
from kvboost_hf.server.scheduling.admission import MemoryCollector
from kvboost_hf.server.scheduling.select import make_queue
from kvboost_hf.server.settings import ServerSettings
from kvboost_hf.store import ChunkStore

__all__ = ["context_length", "create_app"]

logger = logging.getLogger(__name__)



def create_app(model, tokenizer, store: ChunkStore, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving ``model`` with cross-request reuse through ``store``.

    Enables chunk reuse on ``model`` now (``settings.reuse=False`` disables it instead); raises
    ``ValueError`` when the store cannot hold one chunk of the model's K/V. The worker thread
    starts and stops with the app's lifespan (uvicorn, ``TestClient`` as a context manager).
    """
    settings = settings or ServerSettings()
    if settings.reuse:
        strategy = None if settings.recompute_strategy == "exact" else settings.recompute_strategy
        enable_chunk_reuse(model, store, recompute_strategy=strategy, tokenizer=tokenizer)
    else:
        disable_chunk_reuse(model)
    keyring = KeyRing(settings.api_keys_file) if settings.api_keys_file is not None else None  # KeyFileError
    metrics = ServerMetrics(store_bytes=lambda: store.nbytes, queue_depth=lambda: queue.depth)
    tenancy = Tenancy(keyring, store, metrics.registry)
    queue = make_queue(settings, model, tokenizer, store, metrics.registry, lambda: service.admission)
    if streaming_snapshot(model) is not None:  # AWQ layer streaming: its counters on /metrics too
        metrics.registry.register(StreamingCollector(model))
    if store.stats().get("remote") is not None:  # a shared Redis tier: its counters on /metrics too
        metrics.registry.register(RemoteStoreCollector(store))
    service = Service(model, tokenizer, store, settings, queue, metrics, tenancy)
    if service.admission is not None:
        metrics.registry.register(MemoryCollector(lambda: service.admission))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threads_before = torch.get_num_threads()
        if settings.torch_threads is not None:
            torch.set_num_threads(settings.torch_threads)
        queue.start()
        logger.info("serving %s (reuse %s, %s scheduler, %d workers, %d torch threads)", settings.model_name,
                    "on" if settings.reuse else "off", settings.scheduler, queue.workers, torch.get_num_threads())
        try:
            yield
        finally:
            queue.stop()
            store.flush(timeout_s=5.0)  # chunks still queued for a shared remote tier
            torch.set_num_threads(threads_before)

    app = FastAPI(title="kvboost-hf", summary="OpenAI-compatible server with cross-request KV reuse", lifespan=lifespan)
    app.state.queue = queue
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.store = store
    app.state.service = service
    app.state.tenancy = tenancy  # tenancy.reload(): re-read --api-keys (the CLI calls it on SIGHUP)
    install_error_handlers(app)
    app.add_middleware(_AuthAndCount, api_key=settings.api_key, metrics=metrics, max_body_bytes=settings.max_body_bytes,
                       keyring=keyring)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": settings.model_name}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=schemas.ModelList)
    async def list_models() -> schemas.ModelList:
        return schemas.ModelList(data=[service.model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=schemas.ModelCard)
    async def get_model(model_id: str) -> schemas.ModelCard:
        service.check_model_name(model_id)
        return service.model_card()

    @app.get("/v1/stats")
    async def stats(request: Request) -> dict:
        return tenancy.stats(tenancy.grant(request), service.stats)

    @app.delete("/v1/cache")
    async def purge_cache(request: Request, tenant: str | None = None, shared: bool = False) -> dict:
        return await run_in_threadpool(tenancy.purge, tenancy.grant(request), tenant, shared)

    @app.post("/v1/warm")
    async def warm_store(body: schemas.WarmRequest, request: Request) -> dict:
        return await service.warm(body, request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: schemas.CompletionRequest, request: Request):
        return await service.completion(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request):
        return await service.chat_completion(body, request)

    install_tokenizer_routes(app, service)
    return app


# Routes that take the API key and the body-size limit: every /v1 route and vLLM's tokenizer routes.
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")
_BODY_METHODS = ("POST", "PUT", "PATCH")


def guarded(path: str) -> bool:
    """Whether ``path`` needs the API key (when set) and gets the body-size limit."""
    return path.startswith("/v1") or path in TOKENIZER_ROUTES


def _refused_label(path: str, code: int) -> str:
    """The metrics label of a request no route answered (a fixed set: client paths are not labels)."""
    reason = {401: "unauthorized", 413: "body too large"}.get(code)
    if reason is None or not guarded(path):
        return "unmatched"
    return f"{'/v1' if path.startswith('/v1') else path} ({reason})"


class _AuthAndCount:
    """ASGI middleware: Bearer auth (when a key is set) and the body-size limit on guarded routes
    (``/v1`` and the tokenizer routes), and request counting."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, max_body_bytes: int | None = None,
                 keyring: KeyRing | None = None) -> None:
        self.app, self.api_key, self.metrics, self.max_body_bytes = app, api_key, metrics, max_body_bytes
        self.keyring = keyring

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: dict[str, int] = {}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            error = self._auth_error(scope)
            if error is None and guarded(scope["path"]) and scope.get("method") in _BODY_METHODS:
                error, receive = await self._bounded_body(scope, receive)
            if error is not None:
                await error.response()(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            code = status.get("code", 500)
            label = getattr(scope.get("route"), "path", None) or _refused_label(scope["path"], code)
            self.metrics.observe_request(label, code)

    def _auth_error(self, scope) -> APIError | None:
        if (self.api_key is None and self.keyring is None) or not guarded(scope["path"]):
            return None
        headers = dict(scope.get("headers") or [])
        value = headers.get(b"authorization", b"").decode("latin-1").strip()
        token = bearer_token(value)
        if not value:
            message = "missing API key: send 'Authorization: Bearer <key>'"
        elif token is not None and self._accepts(scope, token):
            return None
        else:
            message = "incorrect API key provided"
        return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _accepts(self, scope, token: str) -> bool:
        """Whether ``token`` is the one key, or one of ``--api-keys`` (its grant then goes to request.state.grant)."""
        if self.keyring is None:
            return hmac.compare_digest(token.encode(), self.api_key.encode())
        grant = self.keyring.grant_for(token)
        if grant is not None:
            scope.setdefault("state", {})["grant"] = grant
        return grant is not None

    async def _bounded_body(self, scope, receive):
        """``(413 error or None, receive)``: the body read up to ``max_body_bytes`` (Content-Length is
        checked first) and handed to the app again by the returned ``receive``."""
        limit = self.max_body_bytes
        if limit is None:
            return None, receive
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                  f"(--max-body-size)", code="request_body_too_large")
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"").decode("latin-1").strip()
        if declared.isdigit() and int(declared) > limit:
            return too_large, receive
        messages: list[dict] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left: the app sees it
            size += len(message.get("body", b""))
            if size > limit:
                return too_large, receive
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        return None, replay
