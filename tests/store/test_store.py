import threading

import pytest
import torch

from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import namespace_key

NS = namespace_key({"model": "test"})
LAYERS, HEADS, DIM = 2, 1, 4


def fake_states(tokens):
    """Deterministic per-token K/V so tests can check which tokens a chunk holds."""
    t = torch.tensor(tokens, dtype=torch.float32)

    def states(start, end):
        block = t[start:end].view(1, -1, 1).expand(HEADS, -1, DIM).clone()
        return [block + layer for layer in range(LAYERS)], [-block - layer for layer in range(LAYERS)]

    return states


def put(store, tokens, ns=NS):
    return store.insert(ns, tokens, fake_states(tokens))


def test_lookup_returns_longest_prefix_in_chunks():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    tokens = list(range(10, 20))
    assert put(store, tokens) == 3  # 4 + 4 + 2
    hits = store.lookup(NS, tokens + [99])
    assert [(h.start, h.num_tokens) for h in hits] == [(0, 4), (4, 4), (8, 2)]
    assert hits[1].chunk.keys[0][0, :, 0].tolist() == [14, 15, 16, 17]


def test_partial_overlap_is_reused_at_token_granularity():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(store, list(range(10, 22)))
    prompt = list(range(10, 16)) + [99, 98, 97]
    hits = store.lookup(NS, prompt)
    assert sum(h.num_tokens for h in hits) == 6
    assert hits[-1].num_tokens == 2


def test_single_token_difference_stops_reuse_there():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    tokens = list(range(10, 30))
    put(store, tokens)
    changed = list(tokens)
    changed[9] = 0
    assert sum(h.num_tokens for h in store.lookup(NS, changed)) == 9


def test_max_tokens_caps_reuse():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    tokens = list(range(10, 22))
    put(store, tokens)
    assert sum(h.num_tokens for h in store.lookup(NS, tokens, max_tokens=7)) == 7


def test_other_namespace_misses():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    tokens = list(range(10, 22))
    put(store, tokens)
    assert store.lookup(namespace_key({"model": "other"}), tokens) == []
    assert store.stats()["misses"] == 1


def test_reinsert_is_a_no_op_and_longer_chunk_supersedes_partial():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(store, list(range(10, 16)))  # 4 + partial 2
    assert put(store, list(range(10, 16))) == 0
    assert len(store) == 2
    put(store, list(range(10, 18)))  # full second chunk replaces the partial one
    assert len(store) == 2
    assert [h.num_tokens for h in store.lookup(NS, list(range(10, 18)))] == [4, 4]


def test_budget_is_never_exceeded_and_eviction_counts():
    probe = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(probe, [1, 2, 3, 4])
    chunk_bytes = probe.nbytes
    store = ChunkStore(max_bytes=chunk_bytes * 5, chunk_size=4)
    for i in range(20):
        put(store, [100 + i] + list(range(7)))  # 2 chunks each
        assert store.nbytes <= store.max_bytes
    stats = store.stats()
    assert stats["evictions"] > 0
    assert stats["bytes"] == store.nbytes <= store.max_bytes
    # The most recent sequence survives whole.
    assert sum(h.num_tokens for h in store.lookup(NS, [119] + list(range(7)))) == 8


def test_evicting_a_chain_root_drops_its_descendants():
    probe = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(probe, [1, 2, 3, 4])
    chunk_bytes = probe.nbytes
    store = ChunkStore(max_bytes=chunk_bytes * 3, chunk_size=4)
    put(store, list(range(12)))  # 3 chunks: a full store
    put(store, list(range(50, 54)))  # forces an eviction
    assert store.nbytes <= store.max_bytes
    # No orphan: every remaining chunk is reachable from its namespace.
    reachable = sum(h.num_tokens for h in store.lookup(NS, list(range(12))))
    assert len(store) == 1 + reachable // 4


def test_chunk_larger_than_budget_is_rejected_not_stored():
    store = ChunkStore(max_bytes=300, chunk_size=4)
    assert put(store, [1, 2, 3, 4]) == 0
    assert len(store) == 0 and store.stats()["rejected"] == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_bad_settings_raise(bad):
    with pytest.raises(ValueError):
        ChunkStore(max_bytes=bad)
    with pytest.raises(ValueError):
        ChunkStore(chunk_size=bad)


def test_concurrent_inserts_and_lookups_keep_accounting_consistent():
    store = ChunkStore(max_bytes=40_000, chunk_size=4)

    def work(offset):
        for i in range(30):
            tokens = [offset, i] + list(range(10))
            put(store, tokens)
            store.lookup(NS, tokens)

    threads = [threading.Thread(target=work, args=(o,)) for o in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.nbytes <= store.max_bytes
    assert store.nbytes == sum(e.nbytes for e in store.entries())
    assert store.entries()  # the threads stored something (an error in one fails the test: setup.cfg)


def chunk_bytes(**settings) -> int:
    probe = ChunkStore(max_bytes=10**6, chunk_size=4, **settings)
    put(probe, [1, 2, 3, 4])
    return probe.nbytes


def test_eviction_keeps_the_chunks_that_are_used():
    store = ChunkStore(max_bytes=chunk_bytes() * 4, chunk_size=4, recency_half_life=10_000)
    hot = [7, 7, 7, 7]
    put(store, hot)
    for _ in range(5):
        store.lookup(NS, hot)
    for i in range(10):
        put(store, [100 + i, 1, 2, 3])  # single-chunk sequences that are never read again
    assert store.nbytes <= store.max_bytes
    assert sum(h.num_tokens for h in store.lookup(NS, hot)) == 4
    assert store.stats()["evictions"] >= 7


def test_recency_decays_old_hits():
    store = ChunkStore(max_bytes=chunk_bytes() * 2, chunk_size=4, recency_half_life=1)
    old = [7, 7, 7, 7]
    put(store, old)
    store.lookup(NS, old)
    for i in range(12):  # many operations later, one hit long ago is worth less than a fresh chunk
        put(store, [100 + i, 1, 2, 3])
    assert store.lookup(NS, old) == []


def test_pinned_chunks_are_evicted_last_and_reported():
    store = ChunkStore(max_bytes=chunk_bytes() * 3, chunk_size=4)
    pinned = [9, 9, 9, 9, 8, 8, 8, 8]
    store.insert(NS, pinned, fake_states(pinned), pin=True)
    for i in range(6):
        put(store, [100 + i, 1, 2, 3])
    assert sum(h.num_tokens for h in store.lookup(NS, pinned)) == 8
    stats = store.stats()
    assert stats["pinned_entries"] == 2 and stats["pinned_evictions"] == 0
    for i in range(3):  # pinned sequences alone overflowing the budget still evict, and say so
        more = [50 + i] * 4
        store.insert(NS, more, fake_states(more), pin=True)
    assert store.nbytes <= store.max_bytes
    assert store.stats()["pinned_evictions"] > 0


def test_eviction_cuts_chains_from_their_tail():
    store = ChunkStore(max_bytes=chunk_bytes() * 4, chunk_size=4)
    chain = list(range(16))  # 4 chunks fill the store
    put(store, chain)
    put(store, [99, 98, 97, 96])  # one must go: the tail of the chain, never its root
    assert store.stats()["evictions"] == 1
    assert sum(h.num_tokens for h in store.lookup(NS, chain)) == 12


def test_quantized_store_marks_hits_approximate_except_sinks():
    store = ChunkStore(max_bytes=10**6, chunk_size=4, kv_bits=8, group_size=4, sink_tokens=2)
    tokens = list(range(10, 22))
    put(store, tokens)
    hits = store.lookup(NS, tokens)
    assert [h.exact_tokens for h in hits] == [2, 0, 0]
    k, _ = hits[1].chunk.layer_states(0, 4)
    assert torch.allclose(k[0, :, 0], torch.tensor([14.0, 15, 16, 17]), atol=0.05)
    assert store.stats()["kv_bits"] == 8


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(kv_bits=3), "kv_bits"),
        (dict(kv_bits=16), "kv_bits"),
        (dict(max_bytes=-5), "max_bytes"),
        (dict(group_size=0), "group_size"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(max_disk_bytes=-1, disk_path="/tmp/x"), "max_disk_bytes"),
        (dict(max_disk_bytes=100), "needs disk_path"),
        (dict(disk_path="/proc/kvboost-not-writable"), "not a writable directory"),
    ],
)
def test_bad_store_settings_get_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        ChunkStore(**settings)


def test_group_size_must_divide_head_dim():
    store = ChunkStore(kv_bits=4, group_size=24)
    with pytest.raises(ValueError, match="does not divide the model's head_dim=64"):
        store.check_model(64)
    ChunkStore(kv_bits=4, group_size=32).check_model(64)


def test_read_only_store_serves_but_stores_nothing():
    store = ChunkStore(chunk_size=4)
    put(store, list(range(10, 18)))
    store.read_only = True
    assert put(store, list(range(50, 58))) == 0 and len(store) == 2
    assert sum(h.num_tokens for h in store.lookup(NS, list(range(10, 18)))) == 8


def test_clear_drops_chains_of_several_chunks():
    """clear() forgets a chain's first chunk, which forgets its successors too: no KeyError, no bytes left."""
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(store, list(range(10, 23)))
    put(store, list(range(40, 49)))
    assert len(store) == 7
    store.clear()
    assert len(store) == 0 and store.nbytes == 0
    assert store.lookup(NS, list(range(10, 23))) == []
    assert store.token_chains(NS) == []


def test_token_chains_are_the_stored_sequences():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(store, list(range(10, 23)))
    put(store, list(range(10, 18)) + [90, 91])  # branches after two chunks
    chains = sorted(store.token_chains(NS), key=lambda c: c[1])
    assert [list(ids) for _, ids in chains] == [list(range(10, 23)), list(range(10, 18)) + [90, 91]]
    assert store.token_chains(NS, skip={chains[0][0]}) == [chains[1]]
    assert store.token_chains(namespace_key({"model": "other"})) == []


def test_chain_tails_are_what_was_stored_after_the_chunks_already_read():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    put(store, list(range(10, 23)))  # chunks 10-13, 14-17, 18-21, 22
    whole = store.chain_tails(NS, known=set())
    assert len(whole) == 1 and whole[0].token_ids == tuple(range(10, 23)) and whole[0].context == ()
    known = set(whole[0].keys)
    assert len(known) == 4 and store.chain_tails(NS, known) == []
    put(store, list(range(10, 22)) + [90, 91, 92, 93, 94])  # continues after the third chunk
    (tail,) = store.chain_tails(NS, known, context=3)
    assert tail.token_ids == (90, 91, 92, 93, 94) and tail.context == (19, 20, 21) and len(tail.keys) == 2
    assert store.chain_tails(namespace_key({"model": "other"}), set()) == []
