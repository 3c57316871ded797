"""The request handling behind the server's routes: validation, planning, queueing, waiting and
response shapes (:class:`Service`); the routes themselves are in :mod:`.app`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvboost_hf.planner.memory import MemoryPlanner
from kvboost_hf.server.api import requests as schemas
from kvboost_hf.server.api.errors import APIError
from kvboost_hf.server.decoding.bos import BosCheck, with_warning
from kvboost_hf.server.decoding.logprobs import PROMPT_SLICE_TOKENS, prompt_logprobs
from kvboost_hf.server.decoding.processors import request_processors
from kvboost_hf.server.decoding.schema_support import unsupported_construct
from kvboost_hf.server.decoding.structured import GrammarCompilers, response_format_schema
from kvboost_hf.server.decoding.tools import call_schema
from kvboost_hf.server.engine.generation import Reply, SamplingParams, generate_reply, stop_token_ids
from kvboost_hf.server.observability.metrics import ServerMetrics
from kvboost_hf.server.observability.streaming_metrics import streaming_snapshot
from kvboost_hf.server.routes.choices import ChunkWriter, chat_choice, completion_choice, usage_of
from kvboost_hf.server.routes.prompts import chat_prompt_ids, completion_prompt_ids
from kvboost_hf.server.routes.sse import sse_events
from kvboost_hf.server.routes.tenancy import Tenancy
from kvboost_hf.server.routes.warming import warm_request
from kvboost_hf.server.scheduling.admission import Admitted, Ask, MemoryAdmission, plan_headers
from kvboost_hf.server.scheduling.candidates import (
    Choice,
    PromptPlan,
    candidate_params,
    empty_reply,
    rows_request,
    run_choices,
    runs_as_rows,
)
from kvboost_hf.server.scheduling.workers import Job, QueueFullError
from kvboost_hf.server.settings import ServerSettings
from kvboost_hf.store.scope import CacheScope

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
_POLL_S = 0.25  # how often a waiting non-streaming request checks for a disconnected client
ADMISSION_POLL_S = 0.02  # how often a request waiting for memory retries (a reservation frees when a job ends)


def context_length(model) -> int | None:
    """The model's context (``max_position_embeddings``), or None when the config has none."""
    config = model.config.get_text_config(decoder=True)
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


class Service:
    """The request handling behind the routes (validation, queueing, waiting, response shapes)."""

    def __init__(self, model, tokenizer, store, settings: ServerSettings, queue,
                 metrics: ServerMetrics, tenancy: Tenancy) -> None:
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.settings, self.queue, self.metrics, self.tenancy = settings, queue, metrics, tenancy
        self.context = context_length(model)
        self.eos_ids = stop_token_ids(model, tokenizer)
        self.bos = BosCheck(tokenizer)
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.grammars = GrammarCompilers(settings.grammar_cache_bytes, settings.grammar_compile_timeout,
                                         settings.grammar_compile_slots)
        self.created = int(time.time())
        limits = [v for v in (self.context, settings.max_prompt_tokens) if v is not None]
        self.prompt_limit = min(limits) if limits else None
        self.admission: MemoryAdmission | None = None
        if settings.plan_memory:
            planner = MemoryPlanner.for_model(model, settings.memory_limit, reuse=settings.reuse,
                                              kv_bits_options=settings.kv_bits_fallback)
            self.admission = MemoryAdmission(planner, settings.auto_truncate, next(model.parameters()).device.type,
                                             max_waiting=settings.max_queue)

    # ------------------------------------------------------------------ small pieces
    def model_card(self) -> schemas.ModelCard:
        return schemas.ModelCard(id=self.settings.model_name, created=self.created, max_model_len=self.context)

    def check_model_name(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(404, f"model '{name}' is not served here; this server serves '{self.settings.model_name}'",
                           param="model", code="model_not_found")

    def stats(self) -> dict:
        return {
            "model": self.settings.model_name,
            "reuse_enabled": self.settings.reuse,
            "store": self.store.stats(),
            "queue": {"waiting": self.queue.waiting, "running": self.queue.running, "depth": self.queue.depth,
                      "max_queue": self.queue.max_queue, "workers": self.queue.workers,
                      "scheduler": self.settings.scheduler},
            **({"batching": self.queue.stats()} if hasattr(self.queue, "stats") else {}),
            **self.metrics.snapshot(),
            **({"streaming": streaming} if (streaming := streaming_snapshot(self.model)) is not None else {}),
            **({"memory": self.admission.stats()} if self.admission is not None else {}),
        }

    def check_prompt_length(self, n: int) -> None:
        """400 for an empty prompt; 413 when ``n`` prompt tokens exceed the model's context or ``--max-prompt-tokens``."""
        if n == 0:
            raise APIError(400, "the prompt is empty (0 tokens)", param="messages/prompt", code="empty_prompt")
        if self.prompt_limit is not None and n > self.prompt_limit:
            which = (
                "--max-prompt-tokens"
                if self.settings.max_prompt_tokens == self.prompt_limit
                else "the model's context (max_position_embeddings)"
            )
            raise APIError(
                413,
                f"the prompt has {n} tokens, more than the limit of {self.prompt_limit} tokens ({which})",
                param="messages/prompt", code="context_length_exceeded",
            )

    def sampling(self, body: schemas.SamplingRequest, prompt_tokens: int, default_max: int,
                 scope: CacheScope | None = None) -> SamplingParams:
        room = None if self.context is None else self.context - prompt_tokens
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = default_max if room is None else max(1, min(default_max, room))
        elif room is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's context is {self.context} tokens; the prompt has {prompt_tokens} and max_tokens asks "
                f"for {max_tokens} more: lower max_tokens to at most {max(room, 0)}",
                param="max_tokens", code="context_length_exceeded",
            )
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=body.stop,
                              seed=body.seed, ignore_eos=body.ignore_eos, cache_scope=scope)

    def retry_after(self) -> str:
        mean = self.metrics.snapshot()["latency"]["mean_s"] or 1.0
        return str(max(1, min(600, math.ceil(mean * (self.queue.waiting + 1)))))

    def submit(self, job: Job) -> None:
        try:
            self.queue.submit(job)
        except QueueFullError as err:
            self.metrics.observe_outcome("rejected")
            raise APIError(503, f"server busy: {err}; retry later", code="queue_full",
                           headers={"Retry-After": self.retry_after()}) from None

    def timeout_error(self) -> APIError:
        self.metrics.observe_outcome("timed_out")
        return APIError(504, f"request timed out after {self.settings.request_timeout:g} s (queueing included)",
                        code="timeout")

    async def next_event(self, job: Job, deadline: float, request: Request | None) -> tuple[str, Any]:
        """The job's next event; raises TimeoutError past ``deadline``; ("disconnected", None) when the client left."""
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError
            wait = remaining if request is None else min(remaining, _POLL_S)
            try:
                return await asyncio.wait_for(job.events.get(), timeout=wait)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                if request is not None and await request.is_disconnected():
                    return "disconnected", None

    # ------------------------------------------------------------------ prompts
    async def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        return await completion_prompt_ids(self.tokenizer, prompt, self.vocab_size)

    async def chat_prompt(self, messages: list[schemas.ChatMessage], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> list[int]:
        return await chat_prompt_ids(self.tokenizer, messages, add_generation_prompt, tools)

    async def processors(self, body: schemas.SamplingRequest, schema: dict | None, param: str):
        """The request's per-call logits processor factory (None when it needs none); 400s for bad settings."""
        return await request_processors(body, schema, param, self.grammars, self.tokenizer, self.vocab_size,
                                        self.eos_ids)

    # ------------------------------------------------------------------ endpoints
    async def completion(self, body: schemas.CompletionRequest, request: Request):
        self.check_model_name(body.model)
        scope = self.tenancy.scope(self.tenancy.grant(request), body.cache_salt)
        plans, echoes = [], []
        echo_logprobs = body.echo and body.logprobs is not None
        candidates = body.best_of or body.n
        asks = []
        for prompt in body.prompt:
            prompt_ids = await self.completion_prompt(prompt)
            self.check_prompt_length(len(prompt_ids))
            params = self.sampling(body, len(prompt_ids), COMPLETIONS_DEFAULT_MAX_TOKENS, scope)
            asks.append(Ask(prompt_ids, max(params.max_tokens, 1), candidates, echo_logprobs))
        warning = self.bos.warning([ask.prompt_ids for ask in asks])  # the ids stay as sent; the header says why not
        admitted = await self.admit(asks, request)  # all prompts together: none holds memory while another waits
        try:  # what is admitted is released if the request fails before it is queued
            for prompt, got in zip(body.prompt, admitted):
                plans.append(PromptPlan(got, candidates, body.n))
                if body.echo:
                    same = got.truncated_from is None and isinstance(prompt, str)
                    echoes.append(prompt if same else self.tokenizer.decode(got.prompt_ids))
            longest = max(len(p.prompt_ids) for p in plans)
            params = self.sampling(body, longest, COMPLETIONS_DEFAULT_MAX_TOKENS, scope)
            params.processors = await self.processors(body, None, "prompt")
        except BaseException:
            for got in admitted:
                got.release()
            raise
        if body.logprobs is not None or (body.best_of or body.n) > body.n:
            params.logprobs = body.logprobs or 0  # best_of ranks candidates by their logprob
        return with_warning(await self.generate(request, "/v1/completions", plans, params, body, chat=False,
                                                echoes=echoes or None, echo_logprobs=echo_logprobs), warning)

    async def chat_completion(self, body: schemas.ChatCompletionRequest, request: Request):
        self.check_model_name(body.model)
        tools = body.offered_tools
        prompt_ids = await self.chat_prompt(body.messages, tools=tools or None)
        self.check_prompt_length(len(prompt_ids))
        params = self.sampling(body, len(prompt_ids), self.settings.default_max_tokens,
                               self.tenancy.scope(self.tenancy.grant(request), body.cache_salt))
        forced, name = body.forced_tool
        param = "tools" if forced else "response_format"
        try:
            schema = call_schema(tools, name) if forced else response_format_schema(body.response_format)
        except ValueError as err:
            raise APIError(400, str(err), param="response_format", code="invalid_value") from None
        problem = await run_in_threadpool(unsupported_construct, schema) if schema is not None else None
        if problem is not None:  # the grammar would allow values the schema does not: no guarantee
            raise APIError(400, f"this JSON schema cannot be enforced exactly: {problem}", param=param,
                           code="unsupported_schema")
        if schema is not None:  # a structured reply ends where its grammar ends, never at a stop string
            params.stop = []
        params.processors = await self.processors(body, schema, param)
        if body.logprobs:
            params.logprobs = body.top_logprobs or 0
        (admitted,) = await self.admit([Ask(prompt_ids, params.max_tokens, body.n)], request)
        plans = [PromptPlan(admitted, body.n, body.n)]
        return await self.generate(request, "/v1/chat/completions", plans, params, body, chat=True,
                                   tools=tools or None)

    def sse(self, *args) -> AsyncIterator[str]:
        return sse_events(self, *args)

    async def warm(self, body: schemas.WarmRequest, request: Request) -> dict:
        return await warm_request(self, body, self.tenancy.grant(request))


    async def admit(self, asks: list[Ask], request: Request | None = None) -> list[Admitted]:
        """The memory planner's decision for every prompt of one request, reserved together until the
        request's job ends (``Admitted.release``): 413 when they could not fit even alone; when they fit
        alone but not beside the requests admitted and not ended, the request waits for memory (first come,
        first admitted) up to the request timeout (504), behind at most ``max_queue`` others (else 503).
        Everything is admitted when planning is off."""
        admission = self.admission
        if admission is None:
            return [Admitted(ask.prompt_ids, None) for ask in asks]
        admitted = admission.try_admit(asks)
        if admitted is not None:
            return admitted
        ticket = admission.wait_turn()
        if ticket is None:
            self.metrics.observe_outcome("rejected")
            raise admission.busy_error(self.retry_after())
        deadline = time.perf_counter() + self.settings.request_timeout
        try:
            while (admitted := admission.try_admit(asks, ticket)) is None:
                if time.perf_counter() > deadline:
                    raise self.timeout_error()
                if request is not None and await request.is_disconnected():
                    self.metrics.observe_outcome("cancelled")
                    raise APIError(499, "the client disconnected while waiting for memory", type="cancelled",
                                   code="cancelled")
                await asyncio.sleep(ADMISSION_POLL_S)
        finally:
            admission.leave(ticket)
        return admitted

    async def generate(self, request: Request, route: str, plans: list[PromptPlan], params: SamplingParams,
                       body: schemas.SamplingRequest, chat: bool, tools: list[dict] | None = None,
                       echoes: list[str] | None = None, echo_logprobs: bool = False):
        arrival = time.perf_counter()
        deadline = arrival + self.settings.request_timeout
        stream = bool(body.stream)
        headers = plan_headers([p.admitted for p in plans])
        stream_text = stream and not tools  # a reply that may turn out to be a tool call is sent whole

        def work(job: Job) -> list[Choice]:
            def one(plan: PromptPlan, index: int, candidate: int) -> Reply:
                if params.max_tokens == 0:
                    return empty_reply(len(plan.prompt_ids))
                seeded = candidate_params(params, candidate)
                with self.admission.running(plan.admitted) if self.admission else contextlib.nullcontext():
                    return generate_reply(
                        self.model, self.tokenizer, plan.prompt_ids, seeded, self.eos_ids,
                        store=self.store if self.settings.reuse else None, cancelled=job.cancelled.is_set,
                        on_delta=(lambda piece: job.emit("delta", (index, piece))) if stream_text else None,
                        generate_kwargs=plan.admitted.plan.generate_kwargs if plan.admitted.plan else None,
                    )

            store = self.store if self.settings.reuse else None
            top = params.logprobs or 0

            def score(ids: list[int]):
                admitted = next(p.admitted for p in plans if p.prompt_ids is ids)
                slice_tokens = (admitted.plan and admitted.plan.score_slice_tokens) or PROMPT_SLICE_TOKENS
                admission = self.admission
                with admission.running(admitted, scoring=True) if admission else contextlib.nullcontext():
                    return prompt_logprobs(self.model, ids, top, store, slice_tokens=slice_tokens,
                                           scope=params.cache_scope)

            return run_choices(plans, one, job.cancelled.is_set, score if echo_logprobs else None)

        job = Job(work)  # the worker scheduler runs work
        for plan in plans:  # each prompt's planned bytes are held until the job ends, however it ends
            job.on_end(plan.admitted.release)
        try:
            if runs_as_rows(plans, params, echo_logprobs):  # the batch scheduler runs its generations as rows
                job.request = rows_request(plans, params, stream_text)
            # else the batch scheduler runs work whole, between steps
            self.submit(job)
        except BaseException:
            job.end()  # never queued
            raise
        response_id = schemas.new_id("chatcmpl" if chat else "cmpl")
        try:
            if stream:
                # Wait for the worker to pick the job up, so queue timeouts still get a proper 504.
                kind, value = await self.next_event(job, deadline, request)
                if kind != "started":
                    return self._early_end(job, kind, value)
                writer = ChunkWriter(response_id, schemas.now(), self.settings.model_name, chat,
                                     bool(body.stream_options and body.stream_options.include_usage))
                grant = self.tenancy.grant(request)
                return StreamingResponse(
                    self.sse(job, route, arrival, deadline, writer, plans, params, tools, echoes,
                             lambda: self.tenancy.still_allowed(grant)),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                )
            while True:
                kind, value = await self.next_event(job, deadline, request)
                if kind == "done":
                    break
                if kind != "started":
                    return self._early_end(job, kind, value)
        except TimeoutError:
            job.cancel()
            raise self.timeout_error() from None
        choices: list[Choice] = value
        self.tenancy.check_still_allowed(self.tenancy.grant(request))  # a key removed meanwhile gets nothing
        for choice in choices:
            self._record(route, arrival, choice.reply, params)
        usage = usage_of(plans, choices)
        want_logprobs = params.logprobs is not None and (chat or body.logprobs is not None)
        if chat:
            payload: Any = schemas.ChatCompletion(
                id=response_id, created=schemas.now(), model=self.settings.model_name, usage=usage,
                choices=[chat_choice(self.tokenizer, c, tools, want_logprobs) for c in choices],
            )
        else:
            payload = schemas.Completion(
                id=response_id, created=schemas.now(), model=self.settings.model_name, usage=usage,
                choices=[completion_choice(self.tokenizer, c, echoes[c.index // c.plan.keep] if echoes else None,
                                           want_logprobs) for c in choices],
            )
        return JSONResponse(payload.model_dump(mode="json"), headers=headers) if headers else payload

    def _early_end(self, job: Job, kind: str, value: Any) -> Response:
        """A job that ended before producing a reply: failed, skipped, or its client left."""
        job.cancel()
        if kind == "error":
            self.metrics.observe_outcome("failed")
            raise APIError(500, f"generation failed: {type(value).__name__}: {value}", type="server_error")
        self.metrics.observe_outcome("cancelled")
        return JSONResponse({"error": {"message": "client disconnected", "type": "cancelled", "param": None,
                                       "code": "cancelled"}}, status_code=499)

    def _record(self, route: str, arrival: float, reply: Reply, params: SamplingParams) -> None:
        if reply.finish_reason is None:
            self.metrics.observe_outcome("cancelled")
            return
        self.metrics.observe_outcome("completed")
        ttft = None if reply.first_token_at is None else reply.first_token_at - arrival
        self.metrics.observe_generation(route, ttft, time.perf_counter() - arrival, reply.prompt_tokens,
                                        reply.cached_tokens, reply.completion_tokens)
        self.tenancy.record(params.cache_scope, reply.prompt_tokens, reply.cached_tokens, reply.completion_tokens)
