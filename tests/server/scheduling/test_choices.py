"""n, best_of and several prompts per request: each choice with its own index, each equal to its own request."""

from __future__ import annotations

import json

import httpx
import torch

from kvboost_hf.server.decoding.processors import OpenAIPenalties
from tests.server.conftest import MODEL_NAME, words


def complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 5)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def test_list_prompts_with_n_give_prompt_major_indices(tiny_server):
    client = tiny_server.client()
    prompts = [words(10, 11, 12), words(50, 51)]
    out = complete(client, prompts, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    singles = [complete(client, p).choices[0].text for p in prompts]
    assert [c.text for c in out.choices] == [singles[0], singles[0], singles[1], singles[1]]  # greedy: n copies
    lengths = [len(tiny_server.tokenizer(p)["input_ids"]) for p in prompts]
    assert out.usage.prompt_tokens == sum(lengths)  # each prompt counted once, not once per choice
    assert out.usage.completion_tokens == sum(complete(client, p).usage.completion_tokens for p in prompts) * 2


def test_sampled_n_choices_are_seeded_one_by_one(tiny_server):
    client = tiny_server.client()
    kw = dict(temperature=1.0, seed=11, max_tokens=8)
    many = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words(20)}], n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    one = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": words(20)}], **kw)
    assert many.choices[0].message.content == one.choices[0].message.content  # choice 0 is the n=1 reply
    assert len({c.message.content for c in many.choices}) > 1  # seed + k: different samples


def test_best_of_keeps_the_highest_cumulative_logprob(tiny_server):
    client = tiny_server.client()
    kw = dict(temperature=1.0, seed=5, max_tokens=6)
    candidates = complete(client, words(33, 34), n=4, logprobs=0, **kw).choices
    best = complete(client, words(33, 34), n=1, best_of=4, **kw).choices
    assert len(best) == 1 and best[0].index == 0
    ranked = sorted(candidates, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert best[0].text == ranked[0].text
    assert best[0].logprobs is None  # logprobs were not asked for (best_of computes them internally)


def test_streamed_n_choices_carry_their_index(tiny_server):
    body = {"model": MODEL_NAME, "prompt": [words(60, 61), words(62)], "n": 2, "max_tokens": 4,
            "temperature": 0, "stream": True}
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    full = httpx.post(f"{tiny_server.base_url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert sorted(finishes) == [0, 1, 2, 3]


def test_best_of_below_n_and_streamed_best_of_are_refused(tiny_server):
    for extra, param in (({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
                         ({"prompt": [words(5)] * 9, "n": 2}, "n"), ({"max_tokens": 0}, "max_tokens")):
        body = {"model": MODEL_NAME, "prompt": words(5), "max_tokens": 2, **extra}
        response = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert not response.json()["error"]["message"].startswith("Value error")


def test_logit_bias_and_penalties_apply_through_the_api(tiny_server):
    client, model, tokenizer = tiny_server.client(), tiny_server.model, tiny_server.tokenizer
    forced = complete(client, words(40, 41), max_tokens=4, logit_bias={"77": 100})
    assert forced.choices[0].text == words(77, 77, 77, 77)
    banned = complete(client, words(40, 41), max_tokens=6)
    first = int(banned.choices[0].text.split()[0][1:])
    without = complete(client, words(40, 41), max_tokens=6, logit_bias={str(first): -100})
    assert int(without.choices[0].text.split()[0][1:]) != first
    penalised = complete(client, words(40, 41), max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5)
    ids = tokenizer(words(40, 41))["input_ids"]
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                  logits_processor=[OpenAIPenalties(0.5, 1.5, len(ids))])
    assert penalised.choices[0].text == tokenizer.decode(expected[0, len(ids):])
    bad = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=10, json={
        "model": MODEL_NAME, "prompt": "w5", "logit_bias": {"500": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_streamed_chat_n_choices_each_open_and_close(tiny_server):
    client = tiny_server.client()
    messages = [{"role": "user", "content": words(70, 71)}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, max_tokens=5, temperature=0)
    texts: dict[int, str] = {0: "", 1: ""}
    roles, finishes = [], {}
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=messages, n=2, max_tokens=5,
                                                temperature=0, stream=True):
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1]
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finishes == {c.index: c.finish_reason for c in full.choices}
