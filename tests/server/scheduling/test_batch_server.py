"""The continuous-batching scheduler behind the real server (uvicorn, SDK clients, tiny models)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from kvboost_hf.server import ServerSettings
from kvboost_hf.server.engine.generation import SamplingParams, generate_reply, stop_token_ids
from kvboost_hf.server.scheduling.workers import Job
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, BurstGate, cycle_words, serve, tiny_tokenizer

SYSTEM = cycle_words(40, start=5)  # a shared prefix: later requests reuse it from the store


def request_specs() -> list[dict]:
    """24 requests: prompt lengths from 1 to ~110 words, max_tokens 1-24, some with stop strings."""
    specs = []
    for i in range(24):
        prompt = (SYSTEM + " " if i % 3 else "") + cycle_words(1 + (i * 29) % 70, start=i)
        specs.append({"prompt": prompt, "max_tokens": 1 + (i * 7) % 24, "stream": bool(i % 2), "i": i})
    return specs


def alone(model, tokenizer, spec: dict) -> tuple[str, str, int]:
    ids = tokenizer(spec["prompt"])["input_ids"]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, stop=spec.get("stop", []))
    reply = generate_reply(model, tokenizer, ids, params, stop_token_ids(model, tokenizer))
    return reply.text, reply.finish_reason, reply.completion_tokens


async def send_all(server, specs: list[dict], clients: int) -> dict[int, tuple]:
    client, todo, results = server.async_client(), list(specs), {}

    async def one_client():
        while todo:
            spec = todo.pop(0)
            kw = dict(model=MODEL_NAME, prompt=spec["prompt"], max_tokens=spec["max_tokens"], temperature=0,
                      stop=spec.get("stop") or None)
            if spec["stream"]:
                text, finish = "", None
                async for chunk in await client.completions.create(stream=True, **kw):
                    for choice in chunk.choices:
                        text += choice.text or ""
                        finish = choice.finish_reason or finish
                results[spec["i"]] = (text, finish, None)
            else:
                out = await client.completions.create(**kw)
                results[spec["i"]] = (out.choices[0].text, out.choices[0].finish_reason, out.usage)

    await asyncio.wait_for(asyncio.gather(*(one_client() for _ in range(clients))), timeout=300)
    await client.close()
    return results


def test_concurrent_greedy_clients_get_what_generate_returns_alone():
    model, tokenizer = make_tiny("gemma3", seed=21), tiny_tokenizer()  # sliding (16) and full layers
    specs = request_specs()
    for spec in specs[::4]:  # stop strings the greedy text really contains
        words_out = alone(model, tokenizer, {**spec, "max_tokens": 24})[0].split()
        if len(words_out) > 2:
            spec["stop"], spec["max_tokens"] = [words_out[2]], 24
    expected = {spec["i"]: alone(model, tokenizer, spec) for spec in specs}
    with serve(model, tokenizer, scheduler="batch", max_batch_size=6, max_batched_tokens=24, max_queue=64) as server:
        got = asyncio.run(send_all(server, specs, clients=12))
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
    for spec in specs:
        text, finish, usage = got[spec["i"]]
        assert (text, finish) == expected[spec["i"]][:2], spec
        if usage is not None:
            assert usage.completion_tokens == expected[spec["i"]][2]
    assert any(spec.get("stop") and got[spec["i"]][1] == "stop" for spec in specs)
    batching = stats["batching"]
    assert batching["max_batch_size_seen"] > 1  # requests really shared decode steps
    assert batching["prefill_chunks"] > len(specs)  # long prompts came in several chunks
    assert stats["reuse"]["reused_tokens"] > 0  # the shared prefix came from the store
    cached = [got[s["i"]][2].prompt_tokens_details.cached_tokens for s in specs if got[s["i"]][2] is not None]
    assert max(cached) >= 32


def test_seeded_sampling_returns_the_same_text_whatever_else_is_in_the_batch(monkeypatch):
    model, tokenizer = make_tiny("llama", seed=22), tiny_tokenizer()
    seeded = dict(model=MODEL_NAME, prompt=cycle_words(30), max_tokens=20, temperature=0.9, top_p=0.9, seed=1234,
                  extra_body={"ignore_eos": True})
    with serve(model, tokenizer, scheduler="batch", max_batch_size=8, max_batched_tokens=40) as server:
        first = server.client().completions.create(**seeded).choices[0].text
        gate = model.register_forward_pre_hook(BurstGate(7, monkeypatch))  # the crowd shares steps

        async def crowded():
            client = server.async_client()
            others = [client.completions.create(model=MODEL_NAME, prompt=cycle_words(5 + 9 * k, start=k),
                                                max_tokens=25, temperature=0.7 if k % 2 else 0, seed=k)
                      for k in range(6)]
            outs = await asyncio.gather(*others[:3], client.completions.create(**seeded), *others[3:])
            await client.close()
            return outs[3].choices[0].text

        try:
            crowded_text = asyncio.run(crowded())
        finally:
            gate.remove()
        other_seed = server.client().completions.create(**{**seeded, "seed": 4321}).choices[0].text
        batching = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]
    assert len(first.split()) == 20
    assert crowded_text == first
    assert other_seed != first
    assert batching["max_batch_size_seen"] >= 4


def slow_steps(model, seconds: float = 0.02):
    """Slow every top-level forward (each decode step) so requests overlap; returns (counter, handle)."""
    forwards = []

    def hook(module, args):
        forwards.append(1)
        time.sleep(seconds)

    return forwards, model.register_forward_pre_hook(hook)


def stream_lines(base_url: str, body: dict, keep: int, out: list, done: threading.Event) -> None:
    """Stream ``body``, read ``keep`` SSE data lines into ``out``, then disconnect; ``done`` is set however it
    ends. A refused request or an error chunk raises, which fails the test (setup.cfg: thread exceptions)."""
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        assert line == "data: [DONE]" or "error" not in json.loads(line[6:]), line
                        out.append(line)
                        if len(out) >= keep:
                            break
    finally:
        done.set()


def test_a_disconnect_frees_its_row_while_the_batch_keeps_running():
    model = make_tiny("llama", seed=23)
    with serve(model, tiny_tokenizer(), scheduler="batch", max_batch_size=4, max_batched_tokens=32) as server:
        forwards, handle = slow_steps(model)
        try:
            long = {"model": MODEL_NAME, "prompt": cycle_words(8), "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            kept, left = [], []
            kept_done, left_done = threading.Event(), threading.Event()
            threading.Thread(target=stream_lines, args=(server.base_url, long, 10_000, kept, kept_done),
                             daemon=True).start()
            threading.Thread(target=stream_lines, args=(server.base_url, {**long, "prompt": cycle_words(9, 3)}, 4,
                                                        left, left_done), daemon=True).start()
            server.wait_until(left_done.is_set, "the second client to leave")
            # The row of the client that left is freed at a following step; the other keeps streaming.
            server.wait_until(lambda: server.queue.running == 1, "the disconnected row to be freed")
            streamed = len(kept)
            server.wait_until(lambda: len(kept) > streamed + 5, "the remaining stream to keep moving")
            assert not kept_done.is_set()
            metrics = server.app.state.metrics.snapshot()
            assert metrics["requests"].get("cancelled") == 1
        finally:
            handle.remove()
        server.wait_until(kept_done.is_set, "the long stream to end", timeout=60)
        admission = server.app.state.service.admission
        assert admission.batch_kv_bytes() == 0  # every row's K/V accounting was released


def test_a_long_prompt_is_prefilled_in_chunks_while_streams_keep_moving(monkeypatch):
    model = make_tiny("llama", seed=24)
    events = []  # (job, kind) in the order the scheduler emitted them: what the stream got while the prompt ran
    emit = Job.emit

    def recorded(job, kind, value=None):
        events.append((job, kind))
        emit(job, kind, value)

    monkeypatch.setattr(Job, "emit", recorded)
    with serve(model, tiny_tokenizer(), scheduler="batch", max_batch_size=4, max_batched_tokens=32) as server:
        forwards, handle = slow_steps(model, 0.01)
        try:
            stream = {"model": MODEL_NAME, "prompt": cycle_words(6), "max_tokens": 300, "ignore_eos": True,
                      "stream": True}
            lines, done = [], threading.Event()
            threading.Thread(target=stream_lines, args=(server.base_url, stream, 10_000, lines, done),
                             daemon=True).start()
            server.wait_until(lambda: len(lines) > 3, "the stream to start")
            admission = server.app.state.service.admission
            assert admission.batch_kv_bytes() > 0  # the running row's K/V is accounted
            before_chunks = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]["prefill_chunks"]
            out = server.client().completions.create(model=MODEL_NAME, prompt=cycle_words(400, 11), max_tokens=1)
            stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()["batching"]
        finally:
            handle.remove()
        assert done.wait(60)
    assert lines[-1] == "data: [DONE]"  # the stream ran to its end
    assert out.usage.prompt_tokens == 400
    # 400 prompt tokens at most 31 a step (one token of the budget goes to the stream): >= 13 chunks...
    assert stats["prefill_chunks"] - before_chunks >= 13
    # ... and the running stream got a token in each of those steps instead of waiting for the whole prompt: its
    # deltas the scheduler emitted between the long request's start and its end (counted there, not as the client
    # happened to read them).
    stream, long = [job for job, kind in events if kind == "started"][:2]
    first, last = events.index((long, "started")), events.index((long, "done"))
    assert sum(job is stream and kind == "delta" for job, kind in events[first:last]) >= 10


def test_full_batch_and_queue_is_503_and_stats_and_metrics_show_the_batch():
    model = make_tiny("llama", seed=25)
    with serve(model, tiny_tokenizer(), scheduler="batch", max_batch_size=2, max_batched_tokens=16,
               max_queue=1) as server:
        forwards, handle = slow_steps(model)
        body = {"model": MODEL_NAME, "prompt": cycle_words(5), "max_tokens": 150, "ignore_eos": True, "stream": True}
        streams = [([], threading.Event()) for _ in range(3)]
        try:
            for k, (lines, done) in enumerate(streams):
                # Every stream stays connected until the end: the two rows stay busy while the 503 is checked.
                threading.Thread(target=stream_lines, args=(server.base_url, {**body, "prompt": cycle_words(5, k)},
                                                            10_000, lines, done), daemon=True).start()
                if k < 2:
                    server.wait_until(lambda: server.queue.running == k + 1, "a row to start")
            server.wait_until(lambda: server.queue.waiting == 1, "the third request to wait")
            response = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "queue_full"
            assert server.queue.running == 2 and server.queue.waiting == 1  # nothing had finished meanwhile
        finally:
            handle.remove()
        for lines, done in streams:
            assert done.wait(60) and lines[-1] == "data: [DONE]"  # each stream ran to its end
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=10).json()
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert stats["queue"]["scheduler"] == "batch"
    batching = stats["batching"]
    assert batching["max_batch_size"] == 2 and batching["max_batch_size_seen"] == 2
    assert batching["steps"] > 0 and batching["mean_tokens_per_step"] >= 1
    assert batching["queue_wait_p95_s"] > batching["queue_wait_p50_s"] >= 0  # the third request waited for a row
    for name in ("kvboost_batch_size_bucket", "kvboost_step_tokens_bucket", "kvboost_queue_wait_seconds_bucket",
                 "kvboost_prefill_chunk_tokens_count", "kvboost_batch_steps_total"):
        assert name in metrics


def test_request_timeout_is_504_and_frees_the_row():
    model = make_tiny("llama", seed=26)
    with serve(model, tiny_tokenizer(), scheduler="batch", request_timeout=1.0) as server:
        forwards, handle = slow_steps(model)
        try:
            body = {"model": MODEL_NAME, "prompt": cycle_words(5), "max_tokens": 300, "ignore_eos": True}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
            assert response.status_code == 504
            server.wait_until(lambda: server.queue.depth == 0, "the timed-out row to be freed")
        finally:
            handle.remove()
        assert len(forwards) < 300
        out = server.client().completions.create(model=MODEL_NAME, prompt=cycle_words(5), max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")


def test_warm_runs_between_steps_and_later_rows_reuse_it():
    model = make_tiny("qwen2", seed=27)
    with serve(model, tiny_tokenizer(), scheduler="batch") as server:
        text = cycle_words(48, start=2)
        warmed = httpx.post(f"{server.base_url}/v1/warm", json={"text": text}, timeout=30).json()
        assert warmed["stored_chunks"] >= 2
        out = server.client().completions.create(model=MODEL_NAME, prompt=text + " w7 w8", max_tokens=3,
                                                  temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.parametrize("kwargs, name", [
    (dict(scheduler="continuous"), "scheduler"),
    (dict(scheduler="batch", max_batch_size=0), "max_batch_size"),
    (dict(scheduler="batch", max_batch_size=32, max_batched_tokens=32), "max_batched_tokens"),
])
def test_bad_batch_settings_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ServerSettings(**kwargs)


def test_jobs_without_a_row_request_run_whole_between_steps():
    """What the batch rows do not implement runs as a plain job on the scheduler thread (e.g. warm)."""
    from kvboost_hf.batching import BatchLimits
    from kvboost_hf.server.scheduling.batch import BatchingQueue
    from kvboost_hf.server.scheduling.workers import Job

    model, tokenizer = make_tiny("llama", seed=28), tiny_tokenizer()
    queue = BatchingQueue(model, tokenizer, None, [2], BatchLimits(2, 8), max_queue=4)
    queue.start()

    async def run():
        job = Job(lambda job: ("ran on", threading.current_thread().name))
        queue.submit(job)
        events = [await asyncio.wait_for(job.events.get(), 30) for _ in range(2)]
        return events

    try:
        events = asyncio.run(run())
    finally:
        queue.stop()
    assert events[0][0] == "started"
    assert events[1] == ("done", ("ran on", "kvboost-batch"))
    assert queue.completed == 1 and queue.depth == 0
