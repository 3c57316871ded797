"""vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer probes them)."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, words


def test_tokenize_and_detokenize_round_trip(tiny_server):
    base = tiny_server.base_url
    out = httpx.post(f"{base}/tokenize", json={"prompt": words(7, 8, 9)}, timeout=10).json()
    assert out["tokens"] == tiny_server.tokenizer(words(7, 8, 9))["input_ids"] and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512
    raw = httpx.post(f"{base}/tokenize", json={"prompt": words(7, 8, 9), "add_special_tokens": False}, timeout=10).json()
    assert raw["tokens"] == [7, 8, 9]
    back = httpx.post(f"{base}/detokenize", json={"tokens": [7, 8, 9], "model": MODEL_NAME}, timeout=10).json()
    assert back == {"prompt": words(7, 8, 9)}


def test_tokenize_messages_uses_the_chat_template(tiny_server):
    messages = [{"role": "user", "content": words(10)}]
    out = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages}, timeout=10).json()
    expected = tiny_server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]
    assert out["tokens"] == list(expected)


def test_tokenizer_info_and_errors(tiny_server):
    base = tiny_server.base_url
    info = httpx.get(f"{base}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] == "<bos>" and "w3" in info["chat_template"]
    for route, body, param in (("/detokenize", {"tokens": [5, 9999]}, "tokens"),
                               ("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": "w5", "messages": []}, "prompt")):
        response = httpx.post(f"{base}{route}", json=body, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    wrong = httpx.post(f"{base}/tokenize", json={"prompt": "w5", "model": "gpt-4"}, timeout=10)
    assert wrong.status_code == 404
