"""N-gram proposals over the request and over every chain the store holds."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ControllerSettings, last_request_stats
from kvboost_hf.models.namespace import namespace
from kvboost_hf.speculative.lookup import LookupProposer, store_ngrams
from kvboost_hf.speculative.ngram import LookupSettings, NgramIndex
from tests.conftest import make_tiny, random_ids


def test_longest_ngram_then_most_recent_continuation():
    index = NgramIndex(LookupSettings(max_ngram=3, min_ngram=1))
    index.add_sequence([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 4])
    assert index.propose([6, 7], 3).tokens == (9, 2, 6)  # bigram (6, 7): the later occurrence
    assert index.propose([5, 6, 7], 2).tokens == (8, 1)  # trigram beats the bigram
    assert index.propose([6], 5).tokens == (4,)  # most recent continuation of 6, cut at the end
    assert index.propose([3], 2) is None
    assert index.propose([6, 7], 0) is None


def test_extend_indexes_an_ngram_once_its_continuation_exists():
    index = NgramIndex(LookupSettings(max_ngram=2, min_ngram=1))
    index.extend([1, 2, 3])
    assert index.propose([2], 1).tokens == (3,)
    assert index.propose([3], 1) is None  # nothing followed 3 yet
    index.extend([1, 2, 4])
    assert index.propose([1, 2], 2).tokens == (4,)
    assert index.propose([3], 2).tokens == (1, 2)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="min_ngram"):
        LookupSettings(max_ngram=2, min_ngram=3)


def test_store_chains_feed_the_index(reuse):
    model = make_tiny("llama")
    store = reuse(model, chunk_size=4)
    first = random_ids(18, 40)
    out = model.generate(first, max_new_tokens=10, do_sample=False)
    key = namespace(model)
    chains = store.token_chains(key)
    assert len(chains) == 1
    ids = chains[0][1]
    # the prompt and the reply minus its last token (whose K/V was never computed) are stored
    assert list(ids) == out[0, : len(ids)].tolist() and len(ids) == out.shape[1] - 1
    index = store_ngrams(store, key)
    context = out[0, 5:9].tolist()
    assert index.propose(context, 6).tokens == tuple(out[0, 9:15].tolist())
    # a second request continuing the first: its chain replaces the first as the leaf
    second = torch.cat([out, random_ids(5, 41)], dim=1)
    model.generate(second, max_new_tokens=3, do_sample=False)
    assert len(store.token_chains(key)) == 1
    assert store.token_chains(key, skip={store.token_chains(key)[0][0]}) == []
    assert store.token_chains(b"another namespace") == []


def test_store_draft_proposes_a_reply_seen_in_an_earlier_request(reuse):
    model = make_tiny("qwen2")
    reuse(model, chunk_size=8)
    prompt = random_ids(20, 50)
    ref = model.generate(prompt, max_new_tokens=16, do_sample=False)
    model.generate(prompt, max_new_tokens=16, do_sample=False)  # stored now
    # a fixed draft length: the adaptive one follows measured times, which a loaded machine skews
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, draft="store",
                         speculation=ControllerSettings(adaptive=False, max_tokens=8))
    spec = last_request_stats(model).speculation
    assert torch.equal(out, ref)
    # the reply comes from the store: a prompt-only lookup has no repeats to find in random ids
    assert spec.accepted_tokens >= 10 and spec.acceptance_rate > 0.8, spec
    assert spec.rounds < 10


def test_proposer_prefers_the_longer_match_and_cuts_after_eos():
    store_index = NgramIndex(LookupSettings(max_ngram=4, min_ngram=2))
    store_index.add_sequence([10, 11, 12, 13, 2, 14])

    class Shared:
        def propose(self, context, k):
            return store_index.propose(context, k)

    proposer = LookupProposer(LookupSettings(max_ngram=4, min_ngram=1), Shared(), eos_token_ids=[2])
    ids = torch.tensor([[12, 9, 11, 12]])  # request: 12 -> 9 (unigram); store: (11, 12) -> 13 2 14
    out, logits = proposer.propose(ids, 5)
    assert logits is None and out[0, 4:].tolist() == [13, 2]  # the store's bigram wins, cut after EOS
    assert proposer.source_counts == {"request": 0, "store": 1}
    proposer = LookupProposer(LookupSettings(max_ngram=4, min_ngram=1), Shared(), eos_token_ids=[2])
    out, _ = proposer.propose(torch.tensor([[5, 9, 7, 5]]), 3)
    assert out[0, 4:].tolist() == [9, 7, 5]  # only the request's own text matches
    out, _ = proposer.propose(torch.tensor([[5, 9, 7, 5, 9, 8]]), 3)  # the request grew by two tokens
    assert out.shape[1] == 6  # (9, 8) was never followed by anything: no draft


def test_store_index_never_passes_its_budget_and_keeps_the_newest_chains(reuse):
    from kvboost_hf.speculative.lookup import StoreNgrams

    model = make_tiny("llama")
    store = reuse(model, chunk_size=4)
    key = namespace(model)
    index = StoreNgrams(max_tokens=50)
    outs = []
    for seed in range(2):
        outs.append(model.generate(random_ids(20, 60 + seed), max_new_tokens=2, do_sample=False))
        index.refresh(store, key)
    assert index.tokens == 42  # two 21-token chains
    store.clear()  # both chains evicted: still indexed
    newest = model.generate(random_ids(20, 70), max_new_tokens=2, do_sample=False)
    index.refresh(store, key)  # 42 + 21 > 50: rebuilt from what the store holds now
    assert index.tokens == 21
    assert index.propose(newest[0, 3:9].tolist(), 4).tokens == tuple(newest[0, 9:13].tolist())
    assert index.propose(outs[0][0, 3:9].tolist(), 4) is None  # evicted and past the budget: gone
    for seed in range(4):
        model.generate(random_ids(20, 80 + seed), max_new_tokens=2, do_sample=False)
        index.refresh(store, key)
        assert index.tokens <= 50


def test_an_extended_chain_indexes_only_its_new_chunks(reuse):
    from kvboost_hf.speculative.lookup import StoreNgrams

    model = make_tiny("llama")
    store = reuse(model, chunk_size=4)
    key = namespace(model)
    index = StoreNgrams()
    out = model.generate(random_ids(24, 90), max_new_tokens=4, do_sample=False)
    index.refresh(store, key)
    first = index.tokens
    assert first == out.shape[1] - 1
    turn = torch.cat([out, random_ids(9, 91)], dim=1)
    out2 = model.generate(turn, attention_mask=torch.ones_like(turn), max_new_tokens=4, do_sample=False)
    index.refresh(store, key)
    added = index.tokens - first
    stored = store.token_chains(key)[0][1]
    # only the tokens after the first chain's last whole chunk, plus the n-gram context before them
    assert added <= len(stored) - (first // 4) * 4 + index.settings.max_ngram
    seam = out2[0, first - 3 : first + 3].tolist()  # an n-gram across the seam continues into the new turn
    assert index.propose(seam, 3).tokens == tuple(out2[0, first + 3 : first + 6].tolist())


def test_the_index_byte_estimate_matches_its_measured_memory():
    import tracemalloc

    from kvboost_hf.speculative.lookup import BYTES_PER_INDEXED_TOKEN, STORE_LOOKUP

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 262_144, (20_000,), generator=g).tolist()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = NgramIndex(STORE_LOOKUP)
    index.add_sequence(tokens)
    per_token = (tracemalloc.get_traced_memory()[0] - before) / len(tokens)
    tracemalloc.stop()
    assert 0.5 * BYTES_PER_INDEXED_TOKEN < per_token < 1.5 * BYTES_PER_INDEXED_TOKEN, per_token


def test_the_index_budget_is_a_share_of_the_store():
    from kvboost_hf import ChunkStore
    from kvboost_hf.speculative.lookup import BYTES_PER_INDEXED_TOKEN, INDEX_SHARE, index_token_budget

    store = ChunkStore(max_bytes=100_000_000, chunk_size=8)
    assert index_token_budget(store) * BYTES_PER_INDEXED_TOKEN <= INDEX_SHARE * store.max_bytes
    assert index_token_budget(store) == int(100_000_000 * INDEX_SHARE) // BYTES_PER_INDEXED_TOKEN


def test_default_draft_steps_aside_for_batches_beams_and_calls_without_a_dynamic_cache(reuse):
    from kvboost_hf.speculative import set_default_draft

    model = make_tiny("llama")
    reuse(model)
    set_default_draft(model, "store")
    batch = random_ids(10, 80, batch=2)
    ref_model = make_tiny("llama")
    assert torch.equal(model.generate(batch, max_new_tokens=3, do_sample=False),
                       ref_model.generate(batch, max_new_tokens=3, do_sample=False))
    assert torch.equal(model.generate(batch[:1], max_new_tokens=3, do_sample=False, num_beams=2),
                       ref_model.generate(batch[:1], max_new_tokens=3, do_sample=False, num_beams=2))
    for no_assist in ({"use_cache": False}, {"cache_implementation": "static"}):  # transformers refuses to assist
        assert torch.equal(model.generate(batch[:1], max_new_tokens=3, do_sample=False, **no_assist),
                           ref_model.generate(batch[:1], max_new_tokens=3, do_sample=False, **no_assist))


def test_a_continuation_cut_by_the_sequence_end_is_looked_up_again():
    """Repeating text: the most recent occurrence is one period back and its continuation stops at the end."""
    index = NgramIndex(LookupSettings(max_ngram=3, min_ngram=1))
    index.add_sequence([9, 1, 2, 3, 1, 2, 3, 1, 2])
    assert index.propose([3, 1, 2], 7).tokens == (3, 1, 2, 3, 1, 2, 3)
    index.add_sequence([20, 21, 22, 23, 24, 30, 22, 23])  # (22, 23) -> 24, then (23, 24) -> 30, ...
    proposal = index.propose([5, 22, 23], 5)
    assert proposal.tokens == (24, 30, 22, 23, 24) and proposal.ngram == 2
