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
    assert store.nbytes == sum(e.nbytes for e in store._entries.values())
