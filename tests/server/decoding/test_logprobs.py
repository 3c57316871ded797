"""Logprobs through the API equal the model's own log-softmax (fp32, within 1e-4), with reuse on."""

from __future__ import annotations

import pytest
import torch

from tests.server.conftest import MODEL_NAME, cycle_words, words

TOL = 1e-4


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full forward: row i predicts ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float(), dim=-1)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.strip()[1:]) for t in tokens]  # the word tokenizer: "w12" is id 12


def test_completion_logprobs_are_exact_with_reuse(tiny_server):
    client, tokenizer, model = tiny_server.client(), tiny_server.tokenizer, tiny_server.model
    shared = cycle_words(40, start=5)
    client.completions.create(model=MODEL_NAME, prompt=shared + " " + words(20), max_tokens=2, temperature=0)
    prompt = shared + " " + words(21, 22)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    assert out.usage.prompt_tokens_details.cached_tokens >= 32  # the shared prefix came from the store
    lp = out.choices[0].logprobs
    prompt_ids = tokenizer(prompt)["input_ids"]
    generated = ids_of(lp.tokens)
    assert len(generated) == out.usage.completion_tokens == 6
    ref = reference_logprobs(model, prompt_ids + generated)
    for i, (token, logprob, top) in enumerate(zip(generated, lp.token_logprobs, lp.top_logprobs)):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(logprob - row[token].item()) < TOL
        values, indices = row.topk(3)
        assert sorted(top) == sorted(f"w{j}" for j in indices.tolist())
        for j, value in zip(indices.tolist(), values.tolist()):
            assert abs(top[f"w{j}"] - value) < TOL
        assert token == indices[0].item()  # greedy picks the top token
    text = out.choices[0].text  # each offset points at its token in the text (the word tokenizer puts spaces between)
    assert lp.text_offset[0] == 0 and all(text[o:].startswith(t) for t, o in zip(lp.tokens, lp.text_offset))
    assert lp.text_offset[1] == len(lp.tokens[0]) + 1


def test_echo_with_zero_max_tokens_scores_the_prompt(tiny_server):
    client, tokenizer, model = tiny_server.client(), tiny_server.tokenizer, tiny_server.model
    prompt = cycle_words(37, start=11)
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)  # now in the store
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    ids = tokenizer(prompt)["input_ids"]
    ref = reference_logprobs(model, ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(choice.logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
        assert len(choice.logprobs.top_logprobs[i]) == 2


def test_echo_token_prompts_in_one_request_like_lm_eval(tiny_server):
    """lm-eval's loglikelihood request: token-id prompts, echo, max_tokens 1, logprobs 1, several prompts."""
    client, model = tiny_server.client(), tiny_server.model
    prompts = [[1, 10, 11, 12, 13], [1, 10, 11, 40, 41, 42]]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for ids, choice in zip(prompts, out.choices):
        token_logprobs = choice.logprobs.token_logprobs
        assert len(token_logprobs) == len(ids) + 1  # the prompt, then the one generated token
        ref = reference_logprobs(model, ids)
        for i in range(1, len(ids)):
            assert abs(token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
            assert abs(max(choice.logprobs.top_logprobs[i].values()) - ref[i - 1].max().item()) < TOL


def test_chat_logprobs_and_top_logprobs(tiny_server):
    client, tokenizer, model = tiny_server.client(), tiny_server.tokenizer, tiny_server.model
    messages = [{"role": "user", "content": words(14, 15, 16)}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    generated = ids_of([c.token for c in content])
    ref = reference_logprobs(model, list(prompt_ids) + generated)
    for i, entry in enumerate(content):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(entry.logprob - row[generated[i]].item()) < TOL
        assert [t.token for t in entry.top_logprobs] == [f"w{j}" for j in row.topk(2).indices.tolist()]
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == out.choices[0].message.content


def test_sampled_logprobs_are_the_models_not_the_samplers(tiny_server):
    """With temperature and top_p the reported logprob is still the raw model distribution's."""
    client, tokenizer, model = tiny_server.client(), tiny_server.tokenizer, tiny_server.model
    prompt = words(30, 31)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=1.5, top_p=0.8,
                                    seed=4, logprobs=0)
    ids = tokenizer(prompt)["input_ids"]
    generated = ids_of(out.choices[0].logprobs.tokens)
    ref = reference_logprobs(model, ids + generated)
    for i, token in enumerate(generated):
        assert abs(out.choices[0].logprobs.token_logprobs[i] - ref[len(ids) - 1 + i, token].item()) < TOL


def test_echo_logprobs_of_stored_tokens_come_from_the_store(tiny_server):
    """The second scoring of a prompt forwards only what the store holds no logprobs for."""
    client, tokenizer, model, store = tiny_server.client(), tiny_server.tokenizer, tiny_server.model, tiny_server.store
    forwarded: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: forwarded.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        prompt = cycle_words(45, start=23)  # 45 tokens: 2 whole 16-token chunks and a 13-token tail
        first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        forwarded.clear()
        second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        assert sum(forwarded) == 0  # every chunk of the prompt (16 + 16 + 13 tokens) holds its logprobs
        assert second.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
        ids = tokenizer(prompt)["input_ids"]
        ref = reference_logprobs(model, ids)
        for i in range(1, len(ids)):
            assert abs(second.choices[0].logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
        # A longer prompt sharing the prefix: its stored part is served, the rest computed on top of stored K/V.
        forwarded.clear()
        longer = prompt + " " + words(7, 8, 9)
        third = client.completions.create(model=MODEL_NAME, prompt=longer, max_tokens=0, echo=True, logprobs=0)
        assert sum(forwarded) <= 16 + 3
        ids = tokenizer(longer)["input_ids"]
        ref = reference_logprobs(model, ids)
        assert all(abs(third.choices[0].logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) < TOL
                   for i in range(1, len(ids)))
        # top_logprobs over prompt tokens recompute the whole prompt (and still agree).
        forwarded.clear()
        top = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        assert sum(forwarded) == len(tokenizer(prompt)["input_ids"]) == 45
        recomputed, served = top.choices[0].logprobs.token_logprobs, first.choices[0].logprobs.token_logprobs
        assert recomputed[0] is None and served[0] is None
        assert recomputed[1:] == pytest.approx(served[1:], abs=TOL)
    finally:
        handle.remove()
    chunks = [e for e in store.entries() if e.logprobs is not None]
    assert chunks and all(e.logprobs.dtype == torch.float32 and e.logprobs.shape == (e.num_tokens,) for e in chunks)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("slice_tokens", [5, 16, 256])
def test_prompt_scoring_in_slices_and_on_stored_prefixes_is_exact(family, slice_tokens):
    """Slices smaller than gemma3's sliding window (16) and than a chunk; stored prefix + slices."""
    from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
    from kvboost_hf.server.decoding.logprobs import prompt_logprobs
    from tests.conftest import make_tiny

    model = make_tiny(family, seed=9)
    ids = [1, *[(7 * i) % 90 + 3 for i in range(60)]]
    ref = reference_logprobs(model, ids)
    expected = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    plain = prompt_logprobs(model, ids, 3, slice_tokens=slice_tokens)
    assert plain[0].logprob is None and [e.logprob for e in plain[1:]] == pytest.approx(expected, abs=TOL)
    assert all([i for i, _ in e.top] == ref[k].topk(3).indices.tolist() for k, e in enumerate(plain[1:]))
    store = ChunkStore(max_bytes=20_000_000, chunk_size=16)
    enable_chunk_reuse(model, store)
    try:
        for prompt in (ids[:40], ids, ids):  # nothing stored; 40 tokens stored; everything stored
            got = prompt_logprobs(model, prompt, 0, store, slice_tokens=slice_tokens)
            assert [e.logprob for e in got[1:]] == pytest.approx(expected[: len(prompt) - 1], abs=TOL)
    finally:
        disable_chunk_reuse(model)


def test_logprobs_stop_where_a_stop_string_cut_the_text(tiny_server):
    client = tiny_server.client()
    prompt = words(44, 45)
    free = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    tokens = free.choices[0].logprobs.tokens
    stop = tokens[3]  # the 4th generated word becomes a stop string
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                    stop=[stop])
    first = tokens.index(stop)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].logprobs.tokens == tokens[:first]  # the stop word's token is not part of the reply
    assert cut.choices[0].logprobs.token_logprobs == free.choices[0].logprobs.token_logprobs[:first]


def test_prompt_scoring_holds_one_slice_of_logits_and_a_few_rows_of_log_softmax(monkeypatch):
    """Scoring's peak is what the planner counts: a slice's logits are freed before the next forward runs,
    and the log-softmax never covers more than LOGSOFTMAX_ROWS rows at once."""
    import weakref

    from kvboost_hf.server.decoding import logprobs as module
    from tests.conftest import make_tiny

    model = make_tiny("llama", seed=10)
    ids = [1, *[(5 * i) % 90 + 3 for i in range(70)]]
    alive, rows = [], []
    hooks = [
        model.register_forward_pre_hook(lambda *_: alive.append(sum(r() is not None for r in refs))),
        model.register_forward_hook(lambda module, args, out: refs.append(weakref.ref(out.logits))),
    ]
    refs: list = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda x, *a, **k: rows.append(x.shape[0]) or log_softmax(x, *a, **k))
    try:
        got = module.prompt_logprobs(model, ids, 2, slice_tokens=24)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(alive) == 3 and alive == [0, 0, 0]  # 71 tokens in slices of 24: no earlier logits alive
    assert max(rows) <= module.LOGSOFTMAX_ROWS and sum(rows) == len(ids) - 1
    ref = reference_logprobs(model, ids)
    assert [e.logprob for e in got[1:]] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                         abs=TOL)
