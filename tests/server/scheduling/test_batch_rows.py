"""Requests that used to run whole between batch steps now run as rows of the batch: ``n``,
``best_of``, list prompts, logits processors (grammar, penalties, ``logit_bias``) and logprobs.

Each test checks that the rows really shared batched forwards (a forward hook sees a batch wider
than 1, which a whole ``generate`` call never has) and that what they return equals the worker
path (``generate_reply``) or the single request it stands for.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import jsonschema
import pytest

from kvboost_hf import ChunkStore
from kvboost_hf.server.engine.generation import SamplingParams, generate_reply, stop_token_ids
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, BurstGate, cycle_words, serve, tiny_tokenizer, words
from tests.server.scheduling.test_batch_server import slow_steps, stream_lines

TOL = 1e-4


def forward_widths(model) -> tuple[list[int], object]:
    """Requests in every top-level forward of ``model``: the rows of a packed batch forward, else the
    batch width (a whole ``generate`` call: always 1)."""
    widths: list[int] = []

    def hook(module, args, kwargs):
        rows = getattr(kwargs.get("past_key_values"), "rows", None)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if rows is not None:
            widths.append(len(rows))
        elif ids is not None:
            widths.append(int(ids.shape[0]))

    return widths, model.register_forward_pre_hook(hook, with_kwargs=True)


def batch_stats(server) -> dict:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]


# ---------------------------------------------------------------------------- structured output (Gemma)
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                   "label": {"enum": ["near", "far"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
PLAIN_PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]


STRUCTURED = dict(model="gemma", messages=[{"role": "user", "content": "Give me a point."}], max_tokens=32,
                  temperature=0, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "point", "schema": POINT}})


@pytest.mark.gemma
def test_json_schema_row_runs_beside_plain_streams_and_leaves_them_as_they_are_alone(gemma):
    model, tokenizer = gemma
    eos = stop_token_ids(model, tokenizer)
    alone = [generate_reply(model, tokenizer, tokenizer(p)["input_ids"],
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), eos).text
             for p in PLAIN_PROMPTS]
    store = ChunkStore(max_bytes=400_000_000, chunk_size=32)
    with serve(model, tokenizer, store, model_name="gemma", scheduler="batch", max_batch_size=4) as server:
        # Alone first: it also builds the vocabulary table and compiles the grammar before the concurrent part.
        structured_alone = server.client().chat.completions.create(**STRUCTURED).choices[0].message.content
        widths, handle = forward_widths(model)

        async def together():
            client = server.async_client()

            async def stream(prompt: str) -> str:
                text = ""
                async for chunk in await client.completions.create(
                        model="gemma", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                        extra_body={"ignore_eos": True}):
                    text += chunk.choices[0].text if chunk.choices else ""
                return text

            outs = await asyncio.gather(stream(PLAIN_PROMPTS[0]), client.chat.completions.create(**STRUCTURED),
                                        stream(PLAIN_PROMPTS[1]))
            await client.close()
            return outs

        try:
            first, reply, second = asyncio.run(asyncio.wait_for(together(), timeout=300))
        finally:
            handle.remove()
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), POINT)
    assert reply.choices[0].message.content == structured_alone
    assert [first, second] == alone  # the grammar row neither froze nor disturbed the other rows
    assert max(widths) == 3  # the structured request decoded in the same forwards as both streams


# ---------------------------------------------------------------------------- logprobs
def test_batched_logprobs_equal_the_worker_paths(monkeypatch):
    model, tokenizer = make_tiny("llama", seed=31), tiny_tokenizer()
    eos = stop_token_ids(model, tokenizer)
    prompts = [cycle_words(23, start=4), words(40, 41, 42)]
    expected = [generate_reply(model, tokenizer, tokenizer(p)["input_ids"],
                               SamplingParams(max_tokens=10, temperature=0, logprobs=3), eos) for p in prompts]
    with serve(model, tokenizer, scheduler="batch", max_batch_size=4) as server:
        widths, handle = forward_widths(model)
        gate = model.register_forward_pre_hook(BurstGate(3, monkeypatch))  # the three requests share steps

        async def together():
            client = server.async_client()
            calls = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=10, temperature=0, logprobs=3)
                     for p in prompts]
            chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words(9)}],
                                                  max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
            outs = await asyncio.gather(*calls, chat)
            await client.close()
            return outs

        try:
            *completions, chat = asyncio.run(asyncio.wait_for(together(), timeout=120))
        finally:
            handle.remove()
            gate.remove()
    assert max(widths) >= 2
    for reply, out in zip(expected, completions):
        lp = out.choices[0].logprobs
        assert tokenizer.convert_tokens_to_ids([t.strip() for t in lp.tokens]) == reply.token_ids
        assert len(lp.token_logprobs) == len(reply.logprobs) > 0
        for got, want, top in zip(lp.token_logprobs, reply.logprobs, lp.top_logprobs):
            assert abs(got - want.logprob) < TOL
            assert sorted(top) == sorted(tokenizer.decode([i]) for i, _ in want.top)
            for i, value in want.top:
                assert abs(top[tokenizer.decode([i])] - value) < TOL
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": words(9)}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
    reply = generate_reply(model, tokenizer, list(chat_ids), SamplingParams(max_tokens=10, temperature=0, logprobs=2),
                           eos)
    content = chat.choices[0].logprobs.content
    assert tokenizer.convert_tokens_to_ids([c.token.strip() for c in content]) == reply.token_ids
    for got, want in zip(content, reply.logprobs):
        assert abs(got.logprob - want.logprob) < TOL
        assert [t.token for t in got.top_logprobs] == [tokenizer.decode([i]) for i, _ in want.top]
        assert all(abs(t.logprob - v) < TOL for t, (_, v) in zip(got.top_logprobs, want.top))


# ---------------------------------------------------------------------------- n, best_of, list prompts
@pytest.fixture(scope="module")
def narrow_server():
    """A batch of two rows: a request's third row waits for one of its first two to end."""
    model = make_tiny("llama", seed=32)
    with serve(model, tiny_tokenizer(), scheduler="batch", max_batch_size=2, max_batched_tokens=16) as server:
        yield server


def complete(client, prompt, **kw):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, **kw)


def test_seeded_n_choices_equal_single_requests_with_seed_plus_c(narrow_server):
    client, prompt = narrow_server.client(), words(20, 21, 22)
    kw = dict(temperature=0.9, extra_body={"ignore_eos": True})
    widths, handle = forward_widths(narrow_server.model)
    try:
        many = complete(client, prompt, n=3, seed=100, **kw)
    finally:
        handle.remove()
    assert max(widths) == 2  # the choices decoded together, as rows (the batch holds two)
    singles = [complete(client, prompt, seed=100 + c, **kw).choices[0].text for c in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == singles
    assert len(set(singles)) > 1


def test_best_of_keeps_the_candidate_with_the_highest_cumulative_logprob(narrow_server):
    client, prompt = narrow_server.client(), words(33, 34)
    kw = dict(temperature=1.0, extra_body={"ignore_eos": True})
    candidates = [complete(client, prompt, seed=7 + c, logprobs=0, **kw).choices[0] for c in range(3)]
    widths, handle = forward_widths(narrow_server.model)
    try:
        best = complete(client, prompt, seed=7, n=1, best_of=3, **kw).choices
    finally:
        handle.remove()
    assert max(widths) == 2  # the candidates ran as rows
    scores = [sum(c.logprobs.token_logprobs) for c in candidates]
    assert len(set(scores)) == 3
    assert len(best) == 1 and best[0].index == 0
    assert best[0].text == candidates[scores.index(max(scores))].text
    assert best[0].logprobs is None


def test_list_prompts_give_prompt_major_indices_in_order(narrow_server):
    client = narrow_server.client()
    prompts = [words(50, 51), words(60, 61, 62)]
    kw = dict(temperature=0.8, extra_body={"ignore_eos": True})
    before = batch_stats(narrow_server)["prefill_chunks"]
    out = complete(client, prompts, n=2, seed=3, **kw)
    assert batch_stats(narrow_server)["prefill_chunks"] >= before + 4  # four rows prefilled by the batch
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    singles = [complete(client, p, seed=3 + c, **kw).choices[0].text for p in prompts for c in range(2)]
    assert [c.text for c in out.choices] == singles


# ---------------------------------------------------------------------------- processors equal the worker path
PENALISED = [
    dict(prompt=words(40, 41), max_tokens=12, temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
    dict(prompt=words(40, 41), max_tokens=8, temperature=0, logit_bias={"77": 3.0, "12": -50}),
    dict(prompt=words(30, 31, 32), max_tokens=10, temperature=0.8, seed=9, presence_penalty=1.0,
         logit_bias={"50": 2.0}),
]


def test_penalties_and_logit_bias_as_rows_equal_the_worker_path():
    model, tokenizer = make_tiny("llama", seed=33), tiny_tokenizer()
    results = {}
    for scheduler in ("workers", "batch"):
        with serve(model, tokenizer, scheduler=scheduler) as server:
            before = batch_stats(server)["prefill_chunks"] if scheduler == "batch" else None
            outs = [server.client().completions.create(model=MODEL_NAME, extra_body={"ignore_eos": True}, **body)
                    for body in PENALISED]
            results[scheduler] = [(out.choices[0].text, out.usage.completion_tokens) for out in outs]
            if scheduler == "batch":
                assert batch_stats(server)["prefill_chunks"] >= before + len(PENALISED)  # they ran as rows
    assert results["batch"] == results["workers"]
    assert [tokens for _, tokens in results["batch"]] == [body["max_tokens"] for body in PENALISED]


def test_a_row_whose_grammar_fails_fails_alone():
    """The word-level vocabulary cannot spell JSON: that row's job fails, a stream beside it goes on."""
    model, tokenizer = make_tiny("llama", seed=34), tiny_tokenizer()
    eos = stop_token_ids(model, tokenizer)
    prompt = cycle_words(7)
    alone = generate_reply(model, tokenizer, tokenizer(prompt)["input_ids"],
                           SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), eos).text
    with serve(model, tokenizer, scheduler="batch") as server:
        forwards, handle = slow_steps(model, 0.02)
        try:
            lines, done = [], threading.Event()
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            threading.Thread(target=stream_lines, args=(server.base_url, body, 10_000, lines, done),
                             daemon=True).start()
            server.wait_until(lambda: len(lines) > 3, "the stream to start")
            before = batch_stats(server)["prefill_chunks"]
            failed = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": [{"role": "user", "content": words(12)}], "max_tokens": 5, "n": 2,
                "response_format": {"type": "json_object"}})
            assert not done.is_set()  # the stream was still running when the grammar rows failed
            assert batch_stats(server)["prefill_chunks"] >= before + 2  # the two choices were rows
        finally:
            handle.remove()
        assert done.wait(60)
    assert failed.status_code == 500 and "can continue the grammar" in failed.json()["error"]["message"]
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
    assert streamed == alone


# ---------------------------------------------------------------------------- cancellation
def test_a_disconnected_n_request_frees_all_its_rows():
    model, tokenizer = make_tiny("llama", seed=35), tiny_tokenizer()
    with serve(model, tokenizer, scheduler="batch", max_batch_size=4) as server:
        admission = server.app.state.service.admission
        prompt = cycle_words(8)
        forwards, handle = slow_steps(model)
        try:
            lines, done = [], threading.Event()
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "n": 3}
            threading.Thread(target=stream_lines, args=(server.base_url, body, 40, lines, done), daemon=True).start()
            one_row = admission.planner.kv_bytes(len(tokenizer(prompt)["input_ids"]) + 400)
            # All three rows run, and each accounts its own K/V (they share one memory plan).
            server.wait_until(lambda: server.queue.running == 3 and admission.batch_kv_bytes() == 3 * one_row,
                              "the three rows to run, each accounted")
            server.wait_until(done.is_set, "the client to leave")
            server.wait_until(lambda: server.queue.depth == 0, "every row of the request to be freed")
            assert len(forwards) < 400
        finally:
            handle.remove()
        assert admission.batch_kv_bytes() == 0
        indices = {c["index"] for line in lines if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"]}
        assert indices <= {0, 1, 2} and len(indices) > 1
        out = server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, n=2)
        assert [c.index for c in out.choices] == [0, 1]


def test_a_timed_out_n_request_frees_all_its_rows():
    model = make_tiny("llama", seed=36)
    with serve(model, tiny_tokenizer(), scheduler="batch", max_batch_size=2, request_timeout=1.0) as server:
        forwards, handle = slow_steps(model)
        try:
            body = {"model": MODEL_NAME, "prompt": cycle_words(5), "max_tokens": 300, "ignore_eos": True, "n": 3}
            started = time.monotonic()
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 504
            server.wait_until(lambda: server.queue.depth == 0, "the timed-out rows (and the waiting one) to be freed")
            assert time.monotonic() - started < 20
        finally:
            handle.remove()
        assert server.app.state.service.admission.batch_kv_bytes() == 0
        assert len(forwards) < 300
