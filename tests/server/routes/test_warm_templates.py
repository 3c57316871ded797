"""``POST /v1/warm`` with chat messages warms what later chats with those messages really start with,
on every template style, and its answer says how many tokens they reuse.

Served on the real Gemma-3-270M (its BPE tokenizer may merge template text with what follows), with
its own template (system folded into the first user turn; a system message alone renders nothing),
a ChatML template (a real system turn), a Llama-2 template (system inside the first ``[INST]``) and a
Gemma-2 template (raises on a system role).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import httpx
import pytest

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.generation.warm import PROBE_TEXTS, chat_prefix, probe_texts, reusable_tokens, warm
from tests.server.conftest import serve, tiny_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2 = (  # meta-llama/Llama-2-7b-chat-hf's template
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA2 = (  # google/gemma-2-2b-it's template: no system role
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
SYSTEM = {"role": "system", "content": (
    "You are the assistant of a small furniture workshop. Answer questions about oak, walnut and cherry "
    "boards, joinery, finishing oils and delivery times in two sentences at most, and never quote prices.")}
QUESTION = {"role": "user", "content": "Which wood darkens most in sunlight?"}


@pytest.fixture(scope="module")
def gemma_templates(gemma) -> dict[str, object]:
    model, tokenizer = gemma
    tokenizers = {"gemma": tokenizer}
    for name, template in (("chatml", CHATML), ("llama2", LLAMA2), ("gemma2", GEMMA2)):
        tokenizers[name] = copy.deepcopy(tokenizer)
        tokenizers[name].chat_template = template
    return tokenizers


def served(gemma, tokenizer) -> Iterator:
    return serve(gemma[0], tokenizer, ChunkStore(max_bytes=200_000_000, chunk_size=16), model_name="gemma")


def post_warm(server, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/warm", json={"messages": messages}, timeout=120)


def cached_tokens(server, messages: list[dict]) -> tuple[int, int]:
    reply = server.client().chat.completions.create(model="gemma", messages=messages, max_tokens=1, temperature=0)
    return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens


@pytest.mark.parametrize("name", ["gemma", "chatml", "llama2"])
def test_warmed_system_prompt_is_what_the_next_chat_reuses(gemma, gemma_templates, name):
    tokenizer = gemma_templates[name]
    prefix = chat_prefix(tokenizer, [SYSTEM])
    whole = tokenizer.apply_chat_template([SYSTEM, QUESTION], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    assert whole[: len(prefix)] == prefix  # the warmed tokens begin the real chat
    assert SYSTEM["content"] in tokenizer.decode(prefix)
    with served(gemma, tokenizer) as server:
        answer = post_warm(server, [SYSTEM])
        assert answer.status_code == 200, answer.text
        warmed = answer.json()
        assert warmed["prompt_tokens"] == len(prefix)
        assert 0 < warmed["reusable_tokens"] <= warmed["prompt_tokens"]
        assert warmed["stored_chunks"] > 0
        cached, prompt_tokens = cached_tokens(server, [SYSTEM, QUESTION])
    assert prompt_tokens == len(whole)
    assert cached == warmed["reusable_tokens"]


def test_gemma_prefix_is_the_first_user_turn_up_to_its_text(gemma):
    tokenizer = gemma[1]
    prefix = chat_prefix(tokenizer, [SYSTEM])
    assert tokenizer.decode(prefix) == f"<bos><start_of_turn>user\n{SYSTEM['content']}\n\n"
    # rendered alone, the system message is dropped: the old warm stored the <bos> only
    alone = tokenizer.apply_chat_template([SYSTEM], tokenize=True, return_dict=True)["input_ids"]
    assert len(alone) < 3 < len(prefix)


def test_warmed_history_is_reused_by_the_next_turn_and_by_the_same_question(gemma, gemma_templates):
    history = [SYSTEM, QUESTION, {"role": "assistant", "content": "Cherry darkens most."}]
    follow_up = [*history, {"role": "user", "content": "And walnut?"}]
    with served(gemma, gemma_templates["gemma"]) as server:
        warmed = post_warm(server, history).json()
        assert cached_tokens(server, follow_up)[0] == warmed["reusable_tokens"] > len(chat_prefix(gemma[1], [SYSTEM]))
        asked = post_warm(server, [SYSTEM, QUESTION]).json()  # ends in a user turn: the prefix is the whole prompt
        cached, prompt_tokens = cached_tokens(server, [SYSTEM, QUESTION])
    assert asked["prompt_tokens"] == prompt_tokens
    assert cached == min(asked["reusable_tokens"], prompt_tokens - 1) > 0  # one prompt token is always forwarded


def test_template_without_a_system_role_gets_a_clear_400_and_still_warms_turns(gemma, gemma_templates):
    tokenizer = gemma_templates["gemma2"]
    with served(gemma, tokenizer) as server:
        refused = post_warm(server, [SYSTEM])
        assert refused.status_code == 400
        assert "System role not supported" in refused.json()["error"]["message"]
        history = [QUESTION, {"role": "assistant", "content": "Cherry darkens most."}]
        warmed = post_warm(server, history).json()
        cached, _ = cached_tokens(server, [*history, {"role": "user", "content": "And walnut?"}])
    assert cached == warmed["reusable_tokens"] > 0


def test_library_warm_messages_matches_what_generate_reuses(gemma):
    model, tokenizer = gemma
    store = ChunkStore(max_bytes=200_000_000, chunk_size=16)
    disable_chunk_reuse(model)
    try:
        stats = warm(model, messages=[SYSTEM], store=store, tokenizer=tokenizer)
        prefix = chat_prefix(tokenizer, [SYSTEM])
        assert stats.prompt_tokens == len(prefix)
        promised = reusable_tokens(model, prefix, store)
        assert promised > 0
        enable_chunk_reuse(model, store)
        inputs = tokenizer.apply_chat_template([SYSTEM, QUESTION], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        model.generate(**inputs, max_new_tokens=1, do_sample=False)
        assert last_request_stats(model).reused_tokens == promised
    finally:
        disable_chunk_reuse(model)


def test_library_warm_messages_errors(gemma):
    model, tokenizer = gemma
    store = ChunkStore(max_bytes=10_000_000, chunk_size=16)
    with pytest.raises(ValueError, match="needs tokenizer="):
        warm(model, messages=[SYSTEM], store=store)
    with pytest.raises(ValueError, match="exactly one of"):
        warm(model, "text", store, tokenizer=tokenizer, messages=[SYSTEM])
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        chat_prefix(plain, [SYSTEM])


def test_probes_fall_back_to_vocabulary_entries_when_the_tokenizer_maps_them_alike():
    tokenizer = tiny_tokenizer()  # a word vocabulary: "Hello", "0", "?" are all its unknown token
    assert {tuple(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in PROBE_TEXTS} == {(0,)}
    texts = probe_texts(tokenizer)
    assert len({tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in texts}) == len(texts) == 3
    prefix = chat_prefix(tokenizer, [{"role": "system", "content": "w7 w8"}])
    assert prefix == tokenizer("<bos> w3 w7 w8 w4", add_special_tokens=False)["input_ids"]  # up to the user role word
