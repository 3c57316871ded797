"""Exact reuse on the real embedded Gemma-3-270M (hybrid sliding-window / full attention)."""

from __future__ import annotations

import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from tests.conftest import make_tiny

GREEDY = dict(max_new_tokens=8, do_sample=False)


def long_prompts():
    """A 700-token prompt (beyond Gemma's 512-token window) and one sharing its first 600 tokens."""
    g = torch.Generator().manual_seed(0)
    first = torch.randint(1000, 30000, (1, 700), generator=g)
    first[0, 0] = 2  # <bos>
    second = torch.cat([first[:, :600], torch.randint(1000, 30000, (1, 40), generator=g)], dim=1)
    return first, second


def test_long_prompt_beyond_sliding_window_is_exact(gemma_model):
    model, _ = gemma_model
    first, second = long_prompts()
    kw = dict(GREEDY, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(second, **kw)
    enable_chunk_reuse(model, ChunkStore(max_bytes=500_000_000, chunk_size=128))
    model.generate(first, max_new_tokens=1, do_sample=False)
    out = model.generate(second, **kw)
    stats = last_request_stats(model)
    assert stats.reused_tokens == 600 and stats.recomputed_tokens == 40
    assert torch.equal(out.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
    assert diff <= 1e-4, diff


def test_seeded_sampling_and_prompt_lookup(gemma_model):
    model, tokenizer = gemma_model
    text = "Rain fell on the old town. Rain fell on the old harbour. Rain fell on the"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    longer = tokenizer(text + " quiet streets and the", return_tensors="pt")["input_ids"]
    sample = dict(max_new_tokens=8, do_sample=True, top_k=40, temperature=0.8)
    lookup = dict(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)

    def run():
        outs = []
        for kw in (sample, lookup):
            for prompt in (ids, longer):
                torch.manual_seed(11)
                outs.append(model.generate(prompt, **kw))
        return outs

    refs = run()
    enable_chunk_reuse(model, ChunkStore(max_bytes=200_000_000, chunk_size=16))
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, refs))
    assert last_request_stats(model).reused_tokens > 0


def test_assistant_model_speculative_decoding(gemma_model):
    model, tokenizer = gemma_model
    # A random tiny Gemma 3 sharing the real model's vocabulary: most candidates are rejected,
    # which exercises the cache crops.
    assistant = make_tiny("gemma3", seed=0, num_layers=2, vocab_size=model.config.vocab_size)
    first, second = long_prompts()
    kw = dict(assistant_model=assistant, max_new_tokens=6, do_sample=False)
    ref = model.generate(second, **kw)
    enable_chunk_reuse(model, ChunkStore(max_bytes=500_000_000, chunk_size=128))
    model.generate(first, **kw)
    out = model.generate(second, **kw)
    assert last_request_stats(model).reused_tokens == 600
    assert torch.equal(out, ref)


def test_multi_turn_chat_reuses_whole_conversation(gemma_model):
    model, tokenizer = gemma_model
    kw = dict(max_new_tokens=12, do_sample=False)
    messages = [{"role": "system", "content": "You answer questions about a small bakery in Lyon."}]
    questions = ["When do you open?", "Do you sell croissants?", "Is there seating?", "Can I order a cake?"]
    store = ChunkStore(max_bytes=500_000_000, chunk_size=32)
    previous_prompt_len = 0
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        disable_chunk_reuse(model)
        ref = model.generate(**inputs, **kw)
        enable_chunk_reuse(model, store)
        out = model.generate(**inputs, **kw)
        stats = last_request_stats(model)
        assert torch.equal(out, ref), f"turn {turn}"
        if turn:
            # Everything up to and including the previous prompt is reused, plus the reply tokens
            # that re-tokenize identically.
            assert stats.reused_tokens >= previous_prompt_len, (turn, stats)
        previous_prompt_len = inputs["input_ids"].shape[1]
        reply = tokenizer.decode(out[0, previous_prompt_len:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    assert len(messages) == 9


def test_batch_of_identical_rows_and_beam_search(gemma_model):
    model, tokenizer = gemma_model
    first, second = long_prompts()
    second = second[:, -200:]
    first = torch.cat([second[:, :150], first[:, :60]], dim=1)
    batch = second.repeat(2, 1)
    beams = dict(max_new_tokens=4, num_beams=2, do_sample=False)
    refs = [model.generate(batch, **GREEDY), model.generate(second, **beams)]
    enable_chunk_reuse(model, ChunkStore(max_bytes=500_000_000, chunk_size=64))
    model.generate(first, max_new_tokens=1, do_sample=False)
    assert torch.equal(model.generate(batch, **GREEDY), refs[0])
    assert last_request_stats(model).reused_tokens == 150
    assert torch.equal(model.generate(second, **beams), refs[1])
