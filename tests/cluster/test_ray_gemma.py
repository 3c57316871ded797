"""Two replicas of the real Gemma-3-270M on Ray Serve: a chat's turns stay on one replica, reuse its
history, and reply exactly what one process (same flags, same store settings) replies."""

from __future__ import annotations

import time

from tests.cluster.conftest_ray import ray_server
from tests.server.conftest import serve

TURNS = ["Name three rivers in Europe.", "Which of them is the longest?", "And which country is it in?"]


def chat(post, messages: list[dict]) -> dict:
    reply = post({"model": "gemma", "messages": messages, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply


def test_two_gemma_replicas_keep_a_chat_together_and_reply_as_one_process(gemma):
    import httpx

    from kvboost_hf.store import ChunkStore

    replies, replicas, cached = [], [], []
    with ray_server("--replicas", "2", "--served-model-name", "gemma", "--chunk-size", "32",
                    "--max-cache-bytes", "400MB") as cluster:
        messages: list[dict] = []
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            reply = chat(lambda body: httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=300), messages)
            content = reply.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": content})
            replies.append(content)
            replicas.append(reply.headers["x-kvboost-replica"])
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(1.2)  # a routing-stats period: the replica has reported the turn
    assert len(set(replicas)) == 1, replicas
    assert all(c > 0 for c in cached[1:]), cached
    model, tokenizer = gemma
    with serve(model, tokenizer, ChunkStore(max_bytes=400_000_000, chunk_size=32), model_name="gemma") as local:
        messages = []
        for turn, expected in zip(TURNS, replies):
            messages.append({"role": "user", "content": turn})
            reply = chat(lambda body: httpx.post(local.base_url + "/v1/chat/completions", json=body, timeout=300), messages)
            assert reply.json()["choices"][0]["message"]["content"] == expected
            messages.append({"role": "assistant", "content": expected})
