"""Exact prefix reuse on tiny random models of each family: outputs must equal plain generate."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from kvboost_hf import (
    ChunkReuseCache,
    ChunkStore,
    disable_chunk_reuse,
    enable_chunk_reuse,
    last_request_stats,
    warm,
)
from tests.conftest import VOCAB, make_tiny, random_ids

CHUNK = 8


def new_store(**kw) -> ChunkStore:
    return ChunkStore(max_bytes=kw.pop("max_bytes", 50_000_000), chunk_size=kw.pop("chunk_size", CHUNK))


def prompts(seed: int = 0):
    """A 60-token prompt (longer than the 16-token sliding window), and one sharing its first 45 tokens."""
    first = random_ids(60, seed)
    second = torch.cat([first[:, :45], random_ids(20, seed + 100)], dim=1)
    return first, second


def plain(model, ids, **kw):
    disable_chunk_reuse(model)
    return model.generate(ids, **kw)


def run_with_reuse(model, calls, **kw):
    """Generate for each prompt in ``calls`` with reuse on; returns outputs and per-call stats."""
    store = new_store()
    enable_chunk_reuse(model, store)
    outs, stats = [], []
    for ids in calls:
        outs.append(model.generate(ids, **kw))
        stats.append(last_request_stats(model))
    disable_chunk_reuse(model)
    return outs, stats, store


GREEDY = dict(max_new_tokens=10, do_sample=False)


def test_greedy_identical_and_prefix_reused(tiny):
    first, second = prompts()
    refs = [plain(tiny, first, **GREEDY), plain(tiny, second, **GREEDY)]
    outs, stats, store = run_with_reuse(tiny, [first, second, first], **GREEDY)
    assert torch.equal(outs[0], refs[0]) and torch.equal(outs[1], refs[1]) and torch.equal(outs[2], refs[0])
    assert stats[0].reused_tokens == 0
    assert stats[1].reused_tokens == 45 and stats[1].exact_tokens == 45
    assert stats[1].recomputed_tokens == 20 and stats[1].approximate_tokens == 0
    assert stats[2].reused_tokens == 59  # everything but the last prompt token
    assert store.stats()["entries"] > 0


def test_first_step_logits_match(tiny):
    first, second = prompts(1)
    kw = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = plain(tiny, second, **kw)
    outs, stats, _ = run_with_reuse(tiny, [first, second], **kw)
    assert stats[1].reused_tokens == 45
    for ref_step, step in zip(ref.logits, outs[1].logits):
        assert (ref_step - step).abs().max().item() <= 1e-4


def test_reply_of_previous_turn_is_reused(tiny):
    first, _ = prompts(2)
    out1 = plain(tiny, first, **GREEDY)
    follow_up = torch.cat([out1, random_ids(7, 5)], dim=1)
    ref = plain(tiny, follow_up, **GREEDY)
    outs, stats, _ = run_with_reuse(tiny, [first, follow_up], **GREEDY)
    assert torch.equal(outs[1], ref)
    # Prompt and all forwarded reply tokens (the last sampled one was never forwarded) are reused.
    assert stats[1].reused_tokens == out1.shape[1] - 1


def test_seeded_sampling_identical(tiny):
    first, second = prompts(3)
    kw = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9)
    refs = []
    for ids in (first, second):
        torch.manual_seed(7)
        refs.append(plain(tiny, ids, **kw))
    store = new_store()
    enable_chunk_reuse(tiny, store)
    for ids, ref in zip((first, second), refs):
        torch.manual_seed(7)
        assert torch.equal(tiny.generate(ids, **kw), ref)
    assert last_request_stats(tiny).reused_tokens == 45


@pytest.mark.parametrize("mode", ["assistant", "prompt_lookup"])
def test_assisted_generation_identical(tiny, mode):
    first, second = prompts(4)
    # Repetitive prompts so prompt lookup actually proposes candidates.
    second = torch.cat([second, second[:, 10:30]], dim=1)
    if mode == "assistant":
        assistant = make_tiny(tiny.config.model_type.replace("_text", ""), seed=3, num_layers=1)
        kw = dict(assistant_model=assistant, max_new_tokens=12, do_sample=False)
    else:
        kw = dict(prompt_lookup_num_tokens=3, max_new_tokens=12, do_sample=False)
    refs = [plain(tiny, ids, **kw) for ids in (first, second)]
    outs, stats, _ = run_with_reuse(tiny, [first, second, first], **kw)
    assert torch.equal(outs[0], refs[0]) and torch.equal(outs[1], refs[1]) and torch.equal(outs[2], refs[0])
    assert stats[1].reused_tokens == 45
    assert stats[2].reused_tokens == 59


class TokenCollector(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.chunks.append(None)


def test_streamer_sees_the_same_tokens(tiny):
    first, second = prompts(5)
    ref_stream = TokenCollector()
    plain(tiny, second, streamer=ref_stream, **GREEDY)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, **GREEDY)
    stream = TokenCollector()
    tiny.generate(second, streamer=stream, **GREEDY)
    assert last_request_stats(tiny).reused_tokens == 45
    # The streamer gets the whole prompt first, exactly as without reuse.
    assert len(stream.chunks) == len(ref_stream.chunks)
    for a, b in zip(stream.chunks, ref_stream.chunks):
        assert (a is None and b is None) or torch.equal(a, b)


def test_identical_batch_rows_reuse_and_match(tiny):
    first, second = prompts(6)
    batch = second.repeat(3, 1)
    ref = plain(tiny, batch, **GREEDY)
    outs, stats, _ = run_with_reuse(tiny, [first, batch], **GREEDY)
    assert torch.equal(outs[1], ref)
    assert stats[1].reused_tokens == 45


def test_different_batch_rows_behave_like_dynamic_cache(tiny):
    first, _ = prompts(7)
    batch = torch.cat([first, random_ids(60, 70)], dim=0)
    ref = plain(tiny, batch, **GREEDY)
    outs, stats, store = run_with_reuse(tiny, [first, batch], **GREEDY)
    assert torch.equal(outs[1], ref)
    assert stats[1].reused_tokens == 0 and stats[1].reason == "batch rows differ"


def test_left_padded_batch_behaves_like_dynamic_cache(tiny):
    first, _ = prompts(8)
    batch = torch.cat([first, first], dim=0)
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    batch = batch.clone()
    batch[1, :5] = 0
    ref = plain(tiny, batch, attention_mask=mask, **GREEDY)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, **GREEDY)
    out = tiny.generate(batch, attention_mask=mask, **GREEDY)
    assert torch.equal(out, ref)
    assert last_request_stats(tiny).reused_tokens == 0


def test_beam_search_identical(tiny):
    first, second = prompts(9)
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False)
    ref = plain(tiny, second, **kw)
    outs, stats, _ = run_with_reuse(tiny, [first, second, second], **kw)
    assert torch.equal(outs[1], ref) and torch.equal(outs[2], ref)
    assert stats[1].reused_tokens == 45
    assert stats[2].reused_tokens == 64  # beam search stores the prompt only


def test_explicit_cache_form_and_auto_form_agree(tiny):
    first, second = prompts(10)
    ref = plain(tiny, second, **GREEDY)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, past_key_values=ChunkReuseCache(tiny.config, store), **GREEDY)
    out = tiny.generate(second, past_key_values=ChunkReuseCache(tiny.config, store), **GREEDY)
    assert torch.equal(out, ref)
    assert last_request_stats(tiny).reused_tokens == 45


def test_cache_object_passed_to_two_calls_gives_correct_output(tiny):
    first, second = prompts(11)
    refs = [plain(tiny, first, **GREEDY), plain(tiny, second, **GREEDY)]
    store = new_store()
    enable_chunk_reuse(tiny, store)
    cache = ChunkReuseCache(tiny.config, store)
    assert torch.equal(tiny.generate(first, past_key_values=cache, **GREEDY), refs[0])
    # A different prompt with the same (now full) cache object: reset, not silently corrupted.
    assert torch.equal(tiny.generate(second, past_key_values=cache, **GREEDY), refs[1])
    assert last_request_stats(tiny).reused_tokens == 45


def test_deepcopied_prompt_cache_pattern(tiny):
    """HF's documented pattern: prefill a prompt cache once, deepcopy it per request."""
    first, second = prompts(12)
    ref = plain(tiny, second, **GREEDY)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    prompt_cache = ChunkReuseCache(tiny.config, store)
    with torch.no_grad():
        tiny(second[:, :45], past_key_values=prompt_cache, use_cache=True)
    copied = copy.deepcopy(prompt_cache)
    assert copied.store is store
    out = tiny.generate(second, past_key_values=copied, **GREEDY)
    assert torch.equal(out, ref)
    assert prompt_cache.get_seq_length() == 45  # the original is untouched


def test_warm_can_pin_a_sequence(tiny):
    store = new_store()
    warm(tiny, random_ids(20, 21)[0], store, pin=True)
    warm(tiny, random_ids(20, 22)[0], store)
    assert store.stats()["pinned_entries"] == 3  # 8 + 8 + 4 tokens
    assert sum(e.pinned for e in store.entries()) == 3


def test_warm_then_generate_reuses(tiny):
    first, second = prompts(13)
    ref = plain(tiny, second, **GREEDY)
    store = new_store()
    stats = warm(tiny, second[0, :45], store)
    assert stats.prompt_tokens == 45 and stats.stored_chunks == 6
    enable_chunk_reuse(tiny, store)
    assert torch.equal(tiny.generate(second, **GREEDY), ref)
    assert last_request_stats(tiny).reused_tokens == 45


def test_inputs_embeds_only_generation_is_correct_and_not_stored(tiny):
    first, _ = prompts(14)
    embeds = tiny.get_input_embeddings()(first).detach()
    ref = plain(tiny, None, inputs_embeds=embeds, **GREEDY)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    out = tiny.generate(inputs_embeds=embeds, **GREEDY)
    assert torch.equal(out, ref)
    assert len(store) == 0
    assert "inputs_embeds" in last_request_stats(tiny).reason


def test_store_too_small_for_a_chunk_is_refused(tiny):
    with pytest.raises(ValueError, match="cannot hold one"):
        enable_chunk_reuse(tiny, ChunkStore(max_bytes=1000, chunk_size=CHUNK))


def test_small_store_evicts_and_stays_correct(tiny):
    per_token = 2 * tiny.config.num_hidden_layers * 2 * 16 * 4  # layers x (K, V) x kv_heads x head_dim x fp32
    store = ChunkStore(max_bytes=per_token * 70, chunk_size=CHUNK)
    for seed in range(4):
        ids = random_ids(40, 200 + seed)
        ref = plain(tiny, ids, **GREEDY)
        enable_chunk_reuse(tiny, store)
        assert torch.equal(tiny.generate(ids, **GREEDY), ref)
        assert store.nbytes <= store.max_bytes
    assert store.stats()["evictions"] > 0


def test_altered_store_entry_changes_output(tiny):
    """The cache must have teeth: corrupting stored K/V must show up in the output."""
    first, second = prompts(15)
    kw = dict(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = plain(tiny, second, **kw)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, **kw)
    for entry in store.entries():
        for tensor in (*entry.keys, *entry.values):
            tensor.mul_(-3.0)
    out = tiny.generate(second, **kw)
    assert last_request_stats(tiny).reused_tokens == 45
    assert (out.logits[0] - ref.logits[0]).abs().max().item() > 1e-3


def test_single_token_difference_reuses_up_to_that_token(tiny):
    first, _ = prompts(16)
    changed = first.clone()
    changed[0, 30] = (changed[0, 30] + 1) % VOCAB
    ref = plain(tiny, changed, **GREEDY)
    outs, stats, _ = run_with_reuse(tiny, [first, changed], **GREEDY)
    assert torch.equal(outs[1], ref)
    assert stats[1].reused_tokens == 30


def test_other_model_weights_miss(tiny):
    first, _ = prompts(17)
    store = new_store()
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, **GREEDY)
    other = make_tiny(tiny.config.model_type.replace("_text", ""), seed=42)
    enable_chunk_reuse(other, store)
    ref = plain(other, first, **GREEDY)
    enable_chunk_reuse(other, store)
    assert torch.equal(other.generate(first, **GREEDY), ref)
    assert last_request_stats(other).reused_tokens == 0


def test_cold_request_does_no_extra_forward(tiny):
    first, _ = prompts(18)
    calls = []
    handle = tiny.register_forward_hook(lambda m, a, kw, out: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        plain(tiny, first, **GREEDY)
        plain_calls = list(calls)
        calls.clear()
        enable_chunk_reuse(tiny, new_store())
        tiny.generate(first, **GREEDY)
    finally:
        handle.remove()
    assert calls == plain_calls


def test_empty_prompt_gets_a_clear_error(tiny):
    enable_chunk_reuse(tiny, new_store())
    with pytest.raises(ValueError, match="empty prompt"):
        tiny.generate(torch.empty((1, 0), dtype=torch.long), **GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        warm(tiny, [], new_store())


def test_enable_is_idempotent_and_disable_restores(tiny):
    store = new_store()
    enable_chunk_reuse(tiny, store)
    enable_chunk_reuse(tiny, store)
    assert len(tiny._forward_pre_hooks) == 1
    disable_chunk_reuse(tiny)
    assert "generate" not in tiny.__dict__ and not tiny._forward_pre_hooks
    first, _ = prompts(19)
    tiny.generate(first, **GREEDY)
    assert len(store) == 0


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reuse_is_reported_approximate_and_stays_close(tiny, bits):
    first, second = prompts(20)
    kw = dict(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = plain(tiny, second, **kw)
    store = ChunkStore(max_bytes=50_000_000, chunk_size=CHUNK, kv_bits=bits, group_size=8, sink_tokens=4)
    enable_chunk_reuse(tiny, store)
    tiny.generate(first, **kw)
    out = tiny.generate(second, **kw)
    stats = last_request_stats(tiny)
    assert (stats.reused_tokens, stats.exact_tokens, stats.approximate_tokens) == (45, 4, 41)
    diff = (out.logits[0] - ref.logits[0]).abs().max().item()
    assert 0 < diff < (0.05 if bits == 8 else 0.5), diff


def test_threads_sharing_one_store_match_sequential_runs(tiny):
    import threading

    base = random_ids(40, 300)
    requests = [torch.cat([base[:, : 20 + 2 * i], random_ids(6, 310 + i)], dim=1) for i in range(8)]
    refs = [plain(tiny, ids, **GREEDY) for ids in requests]
    store = new_store()
    enable_chunk_reuse(tiny, store)
    results, errors = {}, []

    def worker(indices):
        try:
            for i in indices:
                results[i] = tiny.generate(requests[i], **GREEDY)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=([i, i + 4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(results[i], refs[i]) for i in range(8))
    stats = store.stats()
    assert stats["hits"] + stats["misses"] == len(requests)
    assert stats["bytes"] == sum(e.nbytes for e in store.entries()) <= store.max_bytes
