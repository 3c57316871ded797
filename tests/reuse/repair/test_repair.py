"""Position-independent reuse on tiny models: content hits, RoPE moves and each repair strategy."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from kvboost_hf.reuse.repair.base import decoder_layers
from tests.conftest import make_tiny, random_ids

BOS = torch.tensor([1])
ONE_STEP = dict(max_new_tokens=1, do_sample=False, output_logits=True, return_dict_in_generate=True)


def documents():
    return random_ids(40, 1)[0], random_ids(40, 2)[0], random_ids(10, 3)[0], random_ids(6, 4)[0]


def reordered_prompt():
    a, b, system, question = documents()
    return torch.cat([BOS, system, b, a, question]).unsqueeze(0)


def warmed_store(model, chunk_size=16) -> ChunkStore:
    a, b, _, _ = documents()
    store = ChunkStore(max_bytes=10**8, chunk_size=chunk_size)
    warm(model, torch.cat([BOS, a]), store)
    warm(model, torch.cat([BOS, b]), store)
    return store


def first_logits(model, prompt, **enable):
    if enable:
        enable_chunk_reuse(model, warmed_store(model), **enable)
    out = model.generate(prompt, **ONE_STEP)
    stats = last_request_stats(model) if enable else None
    disable_chunk_reuse(model)
    return out.logits[0], stats


class LayerCounter:
    """Counts the tokens each decoder layer processes (post hooks: only layers that ran to the end)."""

    def __init__(self, model):
        layers = decoder_layers(model)
        self.counts = [0] * len(layers)
        self.handles = [
            layer.register_forward_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)
        ]

    def _hook(self, i):
        def count(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.counts[i] += hidden.shape[1]

        return count

    def remove(self):
        for h in self.handles:
            h.remove()


def test_reordered_documents_use_content_hits_reported_approximate(tiny):
    prompt = reordered_prompt()
    ref, _ = first_logits(tiny, prompt)
    logits, stats = first_logits(tiny, prompt, recompute_strategy="none")
    assert stats.strategy == "none"
    assert stats.exact_tokens == 1  # <bos>
    assert stats.approximate_tokens == 80  # both documents, whole, although they moved
    assert stats.recomputed_tokens == prompt.shape[1] - 81
    # Stitching without repair is approximate: it must differ from full prefill. (Tiny Mistral has
    # only 16-token sliding windows: deep inside a document, K/V never see what preceded it.)
    if tiny.config.model_type != "mistral":
        assert (logits - ref).abs().max().item() > 1e-3


def test_cacheblend_at_ratio_one_equals_full_prefill(tiny):
    prompt = reordered_prompt()
    ref, _ = first_logits(tiny, prompt)
    logits, stats = first_logits(tiny, prompt, recompute_strategy="cacheblend", recompute_ratio=1.0)
    assert stats.approximate_tokens == 0 and stats.strategy == "cacheblend"
    assert (logits - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("strategy", ["none", "selective", "cacheblend"])
def test_strategy_computes_exactly_the_tokens_it_reports(tiny, strategy):
    prompt = reordered_prompt()
    enable_chunk_reuse(tiny, warmed_store(tiny), recompute_strategy=strategy, recompute_ratio=0.25, seam_tokens=4)
    counter = LayerCounter(tiny)
    try:
        tiny.generate(prompt, max_new_tokens=1, do_sample=False)
    finally:
        counter.remove()
    stats = last_request_stats(tiny)
    disable_chunk_reuse(tiny)
    assert counter.counts == stats.layer_tokens
    prompt_len, hit_tokens = prompt.shape[1], 80
    if strategy == "none":
        assert stats.layer_tokens == [prompt_len - 1 - hit_tokens] * len(stats.layer_tokens)
    elif strategy == "selective":  # two seams (each document starts one) of 4 tokens
        assert stats.layer_tokens == [prompt_len - 1 - hit_tokens + 8] * len(stats.layer_tokens)
    else:  # every token through layers 0..1, the selected 25% of reused tokens + the rest beyond
        selected = prompt_len - 1 - hit_tokens + 20
        assert stats.layer_tokens[:2] == [prompt_len - 1 + selected] * 2
        assert stats.layer_tokens[2:] == [selected] * (len(stats.layer_tokens) - 2)
        assert stats.approximate_tokens == hit_tokens - 20


def test_repair_quality_orders_as_expected(tiny):
    if tiny.config.model_type == "mistral":
        tiny = make_tiny("llama", seed=5)  # see above: windows hide the seam on tiny Mistral
    prompt = reordered_prompt()
    ref, _ = first_logits(tiny, prompt)
    err = {}
    for strategy, ratio in [("none", 0.0), ("cacheblend", 0.5)]:
        logits, _ = first_logits(tiny, prompt, recompute_strategy=strategy, recompute_ratio=ratio)
        err[strategy] = (logits - ref).abs().max().item()
    assert err["cacheblend"] < err["none"]


def test_gaps_do_not_block_later_hits(tiny):
    a, b, _, question = documents()
    prompt = torch.cat([BOS, a, random_ids(9, 50)[0], b, question]).unsqueeze(0)
    _, stats = first_logits(tiny, prompt, recompute_strategy="none")
    # <bos> + a is an exact prefix of the prompt (warmed that way); b comes after a 9-token gap.
    assert (stats.exact_tokens, stats.approximate_tokens) == (41, 40)


@pytest.mark.parametrize("offset", [3, 17, 50])
def test_document_found_at_any_offset_and_first_token_merge_costs_one(offset):
    model = make_tiny("llama")
    a, b, _, question = documents()
    filler = random_ids(offset, 60 + offset)[0]
    merged = a.clone()
    merged[0] = (merged[0] + 1) % 90 + 3  # the tokenizer merged the first token with the text before it
    for doc, expected in ((a, 40), (merged, 39)):
        prompt = torch.cat([BOS, filler, doc, question]).unsqueeze(0)
        _, stats = first_logits(model, prompt, recompute_strategy="selective", seam_tokens=0)
        assert stats.approximate_tokens == expected, (offset, expected, stats)


def test_generate_segments_make_chunks_follow_documents():
    model = make_tiny("qwen2")
    a, b, system, question = documents()
    first = torch.cat([BOS, system, a, b, question]).unsqueeze(0)
    starts = [1, 11, 51, 91]
    store = ChunkStore(max_bytes=10**8, chunk_size=32)
    enable_chunk_reuse(model, store, recompute_strategy="none")
    model.generate(first, max_new_tokens=1, do_sample=False, segments=starts)
    chunk_starts = sorted(e.start for e in store.entries())
    assert set(starts) <= set(chunk_starts)
    # b elsewhere: found as a unit, and the question that followed it there continues the hit
    # (all but the prompt's last token, which the real forward always computes).
    later = torch.cat([BOS, random_ids(5, 70)[0], b, question]).unsqueeze(0)
    model.generate(later, max_new_tokens=1, do_sample=False)
    assert last_request_stats(model).approximate_tokens == 40 + 5
    disable_chunk_reuse(model)


def test_separator_and_chat_turns_start_chunks(gemma_model):
    model, tokenizer = gemma_model
    store = ChunkStore(max_bytes=10**9, chunk_size=128)
    enable_chunk_reuse(model, store, tokenizer=tokenizer, separator="\n\n###\n\n")
    messages = [{"role": "user", "content": "Doc one.\n\n###\n\nDoc two."}, {"role": "assistant", "content": "Ok."},
                {"role": "user", "content": "Thanks."}]
    ids = tokenizer.apply_chat_template(messages, return_tensors="pt", return_dict=True)["input_ids"]
    model.generate(ids, max_new_tokens=1, do_sample=False)
    starts = {e.start for e in store.entries()}
    turn = tokenizer.convert_tokens_to_ids("<start_of_turn>")
    turn_positions = {i for i, t in enumerate(ids[0].tolist()) if t == turn and i}
    assert 1 in starts and turn_positions <= starts
    assert len(starts) >= 2 + len(turn_positions)


def test_unsupported_rope_falls_back_to_exact_reuse_with_reason():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt = reordered_prompt()
    ref = model.generate(prompt, max_new_tokens=3, do_sample=False)
    enable_chunk_reuse(model, warmed_store(model), recompute_strategy="selective")
    out = model.generate(prompt, max_new_tokens=3, do_sample=False)
    stats = last_request_stats(model)
    disable_chunk_reuse(model)
    assert torch.equal(out, ref)
    assert stats.approximate_tokens == 0 and "dynamic" in stats.reason


def test_approximate_requests_never_store_tainted_chunks(tiny):
    prompt = reordered_prompt()
    store = warmed_store(tiny)
    before = {e.key for e in store.entries()}
    enable_chunk_reuse(tiny, store, recompute_strategy="selective", seam_tokens=4)
    tiny.generate(prompt, max_new_tokens=4, do_sample=False)
    disable_chunk_reuse(tiny)
    added = [e for e in store.entries() if e.key not in before]
    first_hit = 11  # <bos> + 10 system tokens, then the moved document
    assert all(e.start + e.num_tokens <= first_hit for e in added)


@pytest.mark.parametrize("bad", [dict(recompute_strategy="magic"), dict(recompute_strategy="none", recompute_ratio=1.5),
                                 dict(recompute_strategy="selective", seam_tokens=-1)])
def test_bad_strategy_settings(bad):
    with pytest.raises(ValueError):
        enable_chunk_reuse(make_tiny("llama"), ChunkStore(), **bad)


def test_cacheblend_needs_sdpa():
    model = make_tiny("llama")
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="SDPA"):
        enable_chunk_reuse(model, ChunkStore(), recompute_strategy="cacheblend")


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("strategy", ["none", "selective", "cacheblend"])
@pytest.mark.parametrize("assist", ["prompt_lookup", "assistant_model"])
def test_every_strategy_composes_with_assisted_decoding_on_sliding_window_models(family, strategy, assist):
    """Repaired sliding layers must keep what assisted decoding may crop (window 16, 97-token prompt);
    the prompt has no exact prefix, so layers past cacheblend's check layer start empty too."""
    model = make_tiny(family)
    a, b, system, question = documents()
    prompt = torch.cat([system, b, a, question]).unsqueeze(0)  # no <bos>: nothing exact to start from
    extra = dict(prompt_lookup_num_tokens=3) if assist == "prompt_lookup" else dict(assistant_model=make_tiny(family, seed=1))
    runs = []
    for kw in ({}, extra):
        enable_chunk_reuse(model, warmed_store(model), recompute_strategy=strategy)
        runs.append(model.generate(prompt, max_new_tokens=12, do_sample=False, **kw))
        stats = last_request_stats(model)
        disable_chunk_reuse(model)
        assert stats.approximate_tokens > 0 and stats.exact_tokens == 0
    assert torch.equal(runs[0], runs[1])  # assisted greedy verifies against the same repaired cache
