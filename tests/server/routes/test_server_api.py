"""The OpenAI API surface through the official SDK: chat, completions, streaming, reuse, sampling."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer, words


def chat(client, messages, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)


def test_chat_completion_shape_and_usage(tiny_server):
    client = tiny_server.client()
    out = chat(client, [{"role": "system", "content": words(10, 11)}, {"role": "user", "content": words(12, 13)}],
               max_tokens=6, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion"
    assert out.model == MODEL_NAME
    assert out.id.startswith("chatcmpl-")
    assert len(out.choices) == 1 and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    prompt = tiny_server.tokenizer.apply_chat_template(
        [{"role": "system", "content": words(10, 11)}, {"role": "user", "content": words(12, 13)}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == len(prompt) + 6
    # The reply is what plain greedy generate produces for the same prompt.
    with torch.no_grad():
        ids = tiny_server.model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)
    expected = tiny_server.tokenizer.decode(ids[0, len(prompt):], skip_special_tokens=True)
    assert out.choices[0].message.content == expected


def test_text_completion(tiny_server):
    client = tiny_server.client()
    out = client.completions.create(model=MODEL_NAME, prompt=words(20, 21, 22), max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 5
    assert len(out.choices[0].text.split()) == 5
    # A token-id prompt gives the same completion as its text.
    again = client.completions.create(model=MODEL_NAME, prompt=[20, 21, 22], max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[0].text


def test_completion_default_max_tokens_is_16(tiny_server):
    out = tiny_server.client().completions.create(model=MODEL_NAME, prompt=words(7, 8), temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_streaming_chat_equals_non_streaming_and_ends_with_done(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "user", "content": words(30, 31, 32)}]
    full = chat(client, messages, max_tokens=10)
    stream = chat(client, messages, max_tokens=10, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert roles[0] == "assistant"
    assert usage.completion_tokens == full.usage.completion_tokens
    # The raw SSE stream: data lines only, the last one is [DONE].
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        response = http.post(f"{tiny_server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"


def test_streaming_completion(tiny_server):
    client = tiny_server.client()
    full = client.completions.create(model=MODEL_NAME, prompt=words(40, 41), max_tokens=7, temperature=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=words(40, 41), max_tokens=7, temperature=0, stream=True) if c.choices)
    assert text == full.choices[0].text


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_second_request_reports_reused_tokens(family):
    # A fresh server and store; gemma3 is the hybrid sliding-window case (window 16 < prompt).
    with serve(make_tiny(family, seed=5), tiny_tokenizer()) as server:
        _second_request_reports_reused_tokens(server)


def _second_request_reports_reused_tokens(tiny_server):
    client = tiny_server.client()
    system = cycle_words(60, start=5)
    first = [{"role": "system", "content": system}, {"role": "user", "content": words(50, 51)}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": words(52, 53)}]
    a = chat(client, first, max_tokens=4)
    b = chat(client, second, max_tokens=4)
    tok = tiny_server.tokenizer
    ids_a = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ids_b = tok.apply_chat_template(second, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    common = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    assert common > 60
    assert a.usage.prompt_tokens_details.cached_tokens == 0  # a fresh prefix
    assert b.usage.prompt_tokens_details.cached_tokens == common  # token-granular: everything up to the change
    # And reuse does not change the output: the same request again is cached almost whole, same text.
    c = chat(client, second, max_tokens=4)
    assert c.usage.prompt_tokens_details.cached_tokens == len(ids_b) - 1
    assert c.choices[0].message.content == b.choices[0].message.content


def test_warm_endpoint_makes_the_next_chat_request_hit(tiny_server):
    client = tiny_server.client()
    system = cycle_words(48, start=17)
    warm = httpx.post(f"{tiny_server.base_url}/v1/warm", json={"messages": [{"role": "system", "content": system}]},
                      timeout=30)
    assert warm.status_code == 200
    warmed = warm.json()["prompt_tokens"]
    assert warmed == 1 + 1 + 48 + 1  # <bos>, the system role word, the text, the user role word every chat has next
    assert warm.json()["reusable_tokens"] == warmed
    out = chat(client, [{"role": "system", "content": system}, {"role": "user", "content": words(9)}], max_tokens=2)
    assert out.usage.prompt_tokens_details.cached_tokens == warmed
    text = httpx.post(f"{tiny_server.base_url}/v1/warm", json={"text": cycle_words(20, start=3)}, timeout=30)
    assert text.status_code == 200 and text.json()["prompt_tokens"] == 20
    bad = httpx.post(f"{tiny_server.base_url}/v1/warm", json={"text": "w7", "messages": []}, timeout=30)
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]


def test_stop_strings_cut_the_output_and_end_generation(tiny_server):
    client = tiny_server.client()
    prompt = words(60, 61, 62)
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    tokens = base.choices[0].text.split()
    assert len(tokens) == 12
    stop_word = tokens[4]
    cut = base.choices[0].text.index(stop_word)
    for stop in (stop_word, [stop_word, "never-there"]):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == base.choices[0].text[:cut]
        assert out.choices[0].finish_reason == "stop"
        # Generation ended at the token that completed the stop string.
        assert out.usage.completion_tokens == tokens.index(stop_word) + 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stop=stop_word, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == base.choices[0].text[:cut]


def test_seeded_sampling_is_reproducible(tiny_server):
    client = tiny_server.client()
    kw = dict(model=MODEL_NAME, prompt=words(70, 71), max_tokens=12, temperature=1.5, top_p=0.95,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=11, **kw).choices[0].text
    b = client.completions.create(seed=11, **kw).choices[0].text
    samples = {client.completions.create(seed=s, **kw).choices[0].text for s in range(12, 16)}
    assert a == b
    assert len(samples | {a}) > 1  # sampling does sample


def test_models_health_stats_and_metrics(tiny_server):
    client = tiny_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    chat(client, [{"role": "user", "content": words(80)}], max_tokens=3)
    health = httpx.get(f"{tiny_server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    stats = httpx.get(f"{tiny_server.base_url}/v1/stats", timeout=10).json()
    assert stats["store"]["entries"] > 0 and stats["store"]["bytes"] > 0
    assert stats["reuse"]["prompt_tokens"] > 0
    assert stats["requests"]["completed"] >= 1
    assert stats["ttft"]["count"] >= 1 and stats["ttft"]["p50_s"] > 0
    assert stats["latency"]["p95_s"] >= stats["latency"]["p50_s"] > 0
    assert stats["queue"]["depth"] == 0
    metrics = httpx.get(f"{tiny_server.base_url}/metrics", timeout=10)
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    assert 'kvboost_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "kvboost_time_to_first_token_seconds_bucket" in text
    assert "kvboost_request_latency_seconds_count" in text
    assert "kvboost_reused_prompt_tokens_total" in text
    store_bytes = next(line for line in text.splitlines() if line.startswith("kvboost_store_bytes "))
    assert float(store_bytes.split()[1]) == tiny_server.store.nbytes > 0


def test_unknown_model_is_404(tiny_server):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        tiny_server.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "w9"}])
    assert err.value.body["code"] == "model_not_found"
