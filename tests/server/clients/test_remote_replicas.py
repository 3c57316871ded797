"""Two server processes sharing one Redis: a conversation started on one continues on the other."""

from __future__ import annotations

import time
import uuid

import httpx
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.conftest import MODEL_NAME, cycle_words, save_tiny_model, server_process


def complete(base: str, prompt: str, max_tokens: int = 6):
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})


def wait_for_remote_writes(base: str, timeout_s: float = 30.0) -> None:
    """Writes to the shared tier are asynchronous: wait (bounded) until the replica has none pending."""
    deadline = time.monotonic() + timeout_s
    while True:
        remote = httpx.get(f"{base}/v1/stats", timeout=5).json()["store"]["remote"]
        if remote["writes"] > 0 and remote["pending_writes"] == 0:
            return
        assert time.monotonic() < deadline, f"remote writes never finished: {remote}"
        time.sleep(0.05)


def test_second_replica_continues_the_first_replicas_conversation(tmp_path, redis_url):
    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir, seed=21)
    flags = ("--chunk-size", "16", "--workers", "1", "--remote-store", redis_url,
             "--remote-prefix", f"replicas-{uuid.uuid4().hex[:6]}")
    turn1 = cycle_words(70, start=3)
    with server_process(model_dir, *flags) as first, server_process(model_dir, *flags) as second:
        reply = complete(first, turn1).choices[0].text
        wait_for_remote_writes(first)
        turn2 = f"{turn1} {reply} w40 w41 w42"
        out = complete(second, turn2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(turn2, return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.choices[0].text == tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.usage.prompt_tokens_details.cached_tokens >= len(tokenizer(turn1)["input_ids"])


def test_remote_counters_on_stats_and_metrics(redis_url):
    from kvboost_hf import ChunkStore
    from tests.conftest import make_tiny
    from tests.server.conftest import serve, tiny_tokenizer

    store = ChunkStore(max_bytes=50_000_000, chunk_size=16, remote=redis_url, remote_prefix=f"m-{uuid.uuid4().hex[:6]}")
    with serve(make_tiny("llama", seed=4), tiny_tokenizer(), store) as server:
        complete(server.base_url, cycle_words(40))
        assert store.flush()
        remote = httpx.get(f"{server.base_url}/v1/stats").json()["store"]["remote"]
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert remote["writes"] >= 2 and remote["available"] is True
    assert f"kvboost_remote_writes_total {float(remote['writes'])}" in metrics
    assert "kvboost_remote_available 1.0" in metrics
