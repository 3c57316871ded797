"""What a client can send: out-of-range numbers and malformed shapes are 400s naming the field, the
tokenizer routes take the API key, bodies are bounded, and a seed does what it says and no more."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvboost_hf import ControllerSettings
from kvboost_hf.server.api.requests import MAX_STOP_CHARS, SEED_MAX, SEED_MIN
from kvboost_hf.server.engine.generation import SamplingParams, generate_reply
from kvboost_hf.server.engine.speculation import attach_speculation, build_draft
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer, words

KEY = "secret"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module", params=["workers", "batch"])
def server(request):
    with serve(make_tiny("llama", seed=3), tiny_tokenizer(), api_key=KEY, max_body_bytes=20_000,
               scheduler=request.param) as running:
        yield running


def post(server, path: str, body=None, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60, **kw)


def assert_400(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


def completion(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": words(5, 6), "max_tokens": 2, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": words(5, 6)}], "max_tokens": 2, **kw}


# ---------------------------------------------------------------------------- numbers and shapes
@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 2**64])
def test_seed_outside_int64_is_400(server, seed):
    assert_400(post(server, "/v1/completions", completion(seed=seed, temperature=1)), "seed")
    assert_400(post(server, "/v1/chat/completions", chat(seed=seed, temperature=1)), "seed")


def test_seed_plus_candidate_must_fit(server):
    """Candidate k samples with seed + k: the last candidate's seed must be an int64 too."""
    error = assert_400(post(server, "/v1/completions", completion(seed=SEED_MAX, n=2, temperature=1)), "seed")
    assert str(SEED_MAX - 1) in error["message"]
    assert_400(post(server, "/v1/completions", completion(seed=SEED_MAX - 1, n=1, best_of=3, temperature=1)), "seed")
    assert_400(post(server, "/v1/chat/completions", chat(seed=SEED_MAX, n=3, temperature=1)), "seed")
    for body in (completion(seed=SEED_MAX - 1, n=2, temperature=1), completion(seed=SEED_MIN, temperature=1)):
        assert post(server, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("function", ["f", ["f"], 3, None])
def test_tool_choice_function_must_be_an_object(server, function):
    body = chat(tools=[TOOL], tool_choice={"type": "function", "function": function})
    assert_400(post(server, "/v1/chat/completions", body), "tool_choice")


def test_legacy_function_call_of_the_wrong_shape_is_400(server):
    body = chat(functions=[TOOL["function"]], function_call={"name": {"nested": 1}})
    assert_400(post(server, "/v1/chat/completions", body), "tool_choice")


def test_max_tokens_beyond_any_context_is_400(server):
    assert_400(post(server, "/v1/completions", completion(max_tokens=2**63)), "max_tokens")
    assert_400(post(server, "/v1/chat/completions", chat(max_completion_tokens=2**40)), "max_completion_tokens")


def test_stop_strings_are_bounded_in_total_length(server):
    long_stops = ["w9" * (MAX_STOP_CHARS // 8)] * 5  # 5 x 1,024 characters
    error = assert_400(post(server, "/v1/completions", completion(stop=long_stops)), "stop")
    assert str(MAX_STOP_CHARS) in error["message"]
    assert post(server, "/v1/completions", completion(stop=long_stops[:4])).status_code == 200


# ---------------------------------------------------------------------------- tokenizer routes, bodies
def test_tokenizer_routes_take_the_api_key(server):
    base = server.base_url
    for method, path, body in (("POST", "/tokenize", {"prompt": words(5)}), ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/tokenizer_info", None)):
        for key, status in ((None, 401), ("wrong", 401), (KEY, 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == status, (path, key, response.text)
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # still open
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'route="/tokenize (unauthorized)"' in metrics


def test_bodies_are_bounded_on_v1_and_tokenizer_routes(server):
    big = " ".join(["w7"] * 10_000)  # 30 KB, over the 20 KB limit
    for path, body in (("/tokenize", {"prompt": big}), ("/v1/completions", completion(prompt=big)),
                       ("/detokenize", {"tokens": [5] * 10_000})):
        response = post(server, path, body)
        assert response.status_code == 413, (path, response.text)
        assert response.json()["error"]["code"] == "request_body_too_large"

    def chunks():  # no Content-Length: the limit counts what arrives
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"w7 " * 100
        yield b'"}'

    chunked = httpx.post(f"{server.base_url}/tokenize", content=chunks(), timeout=30,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    small = post(server, "/tokenize", {"prompt": words(5, 6)})
    assert small.status_code == 200 and small.json()["tokens"] == server.tokenizer(words(5, 6))["input_ids"]
    assert post(server, "/v1/completions", completion()).status_code == 200


# ---------------------------------------------------------------------------- seeds and stops in generation
def test_a_greedy_seeded_request_leaves_the_global_rng_alone():
    model, tokenizer = make_tiny("llama", seed=3), tiny_tokenizer()
    prompt = tokenizer(words(5, 6, 7))["input_ids"]
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    reply = generate_reply(model, tokenizer, prompt, SamplingParams(max_tokens=4, temperature=0.0, seed=99), [2])
    assert reply.completion_tokens == 4 or reply.finish_reason == "stop"
    assert torch.equal(torch.get_rng_state(), before)
    sampled = generate_reply(model, tokenizer, prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=99), [2])
    again = generate_reply(model, tokenizer, prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=99), [2])
    assert sampled.token_ids == again.token_ids  # a sampled request's seed still decides its draws


def test_with_a_draft_completion_tokens_stop_at_the_stop_string():
    """Assisted decoding appends a round's tokens at once: the reply keeps those up to the one completing
    the stop, the count (and token ids) plain decoding gives."""
    model, tokenizer = make_tiny("qwen2", seed=6), tiny_tokenizer()
    prompt = cycle_words(30, start=3) + " " + cycle_words(12, start=3)
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    with serve(model, tokenizer) as running:
        plain = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=60).json()
        reply = plain["choices"][0]["text"].split()
        stops = [w for w in dict.fromkeys(reply[1:8]) if reply.index(w) > 0]
        expected = {}
        for stop in stops:
            out = httpx.post(f"{running.base_url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
            expected[stop] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
    assert stops
    with serve(model, tokenizer) as running:
        attach_speculation(running.app, model, build_draft("store", model, tokenizer),
                           ControllerSettings(adaptive=False, max_tokens=4))
        url = f"{running.base_url}/v1/completions"
        assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == plain["choices"][0]["text"]
        for stop in stops:  # warm: the store drafts the whole reply, 4 tokens a round
            out = httpx.post(url, json={**body, "stop": [stop]}, timeout=60).json()
            assert (out["choices"][0]["text"], out["usage"]["completion_tokens"]) == expected[stop], stop
        stats = httpx.get(f"{running.base_url}/v1/stats", timeout=10).json()["speculation"]
        assert stats["accepted_tokens"] > 0
