"""``echo`` on /v1/completions: ``text_offset`` indexes the returned text (special tokens the text
omits have empty text), and a prompt scored from the store reports the tokens it reused."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, cycle_words, words


def offsets_index_the_text(text: str, logprobs: dict) -> None:
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets)
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        assert 0 <= offset <= len(text), (i, token, offset)
        assert text[offset:].startswith(token), (i, token, offset, text[offset:offset + 20])
        assert i == 0 or offset >= offsets[i - 1]


def completion(server, **body) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=300, json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_offsets_of_word_tokens_index_the_text(tiny_server):
    """The word tokenizer decodes tokens without their separating spaces: offsets still point at each token."""
    prompt = words(10, 11, 12, 13)
    out = completion(tiny_server, prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0,
                     ignore_eos=True)
    choice = out["choices"][0]
    assert choice["text"].startswith(prompt)
    offsets_index_the_text(choice["text"], choice["logprobs"])
    assert choice["logprobs"]["text_offset"][:4] == [0, 4, 8, 12]
    plain = completion(tiny_server, prompt=prompt, max_tokens=4, logprobs=0, temperature=0, ignore_eos=True)
    offsets_index_the_text(plain["choices"][0]["text"], plain["choices"][0]["logprobs"])


def test_streamed_echo_offsets_index_the_streamed_text(tiny_server):
    import json

    prompt = words(20, 21, 22)
    lines = []
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 0, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:])["choices"][0] for line in lines]
    text = "".join(c["text"] for c in chunks)
    logprobs = [c["logprobs"] for c in chunks if c["logprobs"]][0]
    assert text.startswith(prompt)
    offsets_index_the_text(text, logprobs)


def test_echo_scored_from_the_store_reports_its_cached_tokens(tiny_server):
    prompt = cycle_words(45, start=61)  # 2 whole 16-token chunks and a 13-token tail
    first = completion(tiny_server, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert first["usage"]["prompt_tokens"] == 45
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was stored yet
    second = completion(tiny_server, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 45  # every logprob came from the store
    # A longer prompt: its stored 45 tokens are not forwarded again (at most the last is, for its logits).
    longer = completion(tiny_server, prompt=prompt + " " + words(7, 8, 9), max_tokens=0, echo=True, logprobs=0)
    cached = longer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert longer["usage"]["prompt_tokens"] == 48 and 32 <= cached <= 45
    # With a generated token the figure is the larger of the two passes over the prompt.
    scored = completion(tiny_server, prompt=prompt, max_tokens=1, echo=True, logprobs=0, temperature=0)
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 45


@pytest.mark.gemma
def test_gemma_echo_offsets_skip_the_bos_the_text_omits(gemma_server):
    prompt = "The café costs 5€ — naïve 日本語 readers, said the old man."
    body = {"model": "gemma", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    response = httpx.post(f"{gemma_server.base_url}/v1/completions", timeout=300, json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"].startswith(prompt)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][0] == "" and logprobs["text_offset"][:2] == [0, 0]  # <bos> is not in the text
    offsets_index_the_text(choice["text"], logprobs)
    ids = gemma_server.tokenizer(prompt)["input_ids"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    # Token-id prompts echo the decoded ids, <bos> included: then <bos> has its text.
    by_ids = httpx.post(f"{gemma_server.base_url}/v1/completions", timeout=300,
                        json={**body, "prompt": ids, "max_tokens": 0}).json()["choices"][0]
    assert by_ids["text"].startswith("<bos>") and by_ids["logprobs"]["tokens"][0] == "<bos>"
    offsets_index_the_text(by_ids["text"], by_ids["logprobs"])
