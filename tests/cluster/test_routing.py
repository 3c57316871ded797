"""The prefix router's decisions: keys exactly as the store cuts and chains them, leading matches only,
the longest holder unless overloaded, power of two choices otherwise, and no match across tenants."""

from __future__ import annotations

import random

from kvboost_hf.cluster.routing import ReplicaReport, matched_chunks, rank_replicas, short
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import owned, prefix_keys
from tests.store.test_store import NS, fake_states

TOKENS = list(range(10, 40))


def held(store: ChunkStore) -> set[bytes]:
    reported = store.held_keys(len(short(b"x" * 16)))
    assert reported == {short(e.key) for e in store.entries()}  # what a replica reports: its store's keys
    return reported


def test_prefix_keys_are_the_keys_the_store_inserts():
    for boundaries in ((), (5,), (3, 17, 18)):
        store = ChunkStore(max_bytes=10**6, chunk_size=8)
        store.insert(NS, TOKENS, fake_states(TOKENS), boundaries=boundaries)
        assert set(prefix_keys(NS, TOKENS, 8, boundaries)) == {e.key for e in store.entries()}


def test_a_replica_matches_leading_chunks_only_and_never_another_tenants():
    store = ChunkStore(max_bytes=10**6, chunk_size=8)
    alice = owned(NS, "alice")
    store.insert(alice, TOKENS[:24], fake_states(TOKENS[:24]))
    assert matched_chunks(prefix_keys(alice, TOKENS, 8), held(store)) == 3
    changed = [99] + TOKENS[1:]
    assert matched_chunks(prefix_keys(alice, changed, 8), held(store)) == 0  # later chunks chain from the first
    assert matched_chunks(prefix_keys(owned(NS, "bob"), TOKENS, 8), held(store)) == 0


def test_the_longest_holder_wins_unless_it_is_overloaded():
    keys = prefix_keys(NS, TOKENS, 8)
    some, more = {short(k) for k in keys[:1]}, {short(k) for k in keys[:3]}
    reports = [ReplicaReport("a", some, queue=0), ReplicaReport("b", more, queue=3), ReplicaReport("c", set(), 0)]
    assert rank_replicas(keys, reports, imbalance=4) == [["b"], ["a", "c"]]
    ranked = rank_replicas(keys, reports, imbalance=2, rng=random.Random(0))  # b is 3 requests behind: pow2
    assert sorted(r for rank in ranked for r in rank) == ["a", "b", "c"] and all(len(rank) == 1 for rank in ranked[:2])
    pair = ranked[:2]
    assert [r.queue for r in reports if r.replica == pair[0][0]][0] <= [r.queue for r in reports
                                                                      if r.replica == pair[1][0]][0]


def test_without_a_hit_two_random_replicas_the_less_loaded_first():
    keys = prefix_keys(NS, TOKENS, 8)
    reports = [ReplicaReport(name, set(), queue=q) for name, q in (("a", 5), ("b", 1), ("c", 3))]
    firsts = {rank_replicas(keys, reports, imbalance=4, rng=random.Random(seed))[0][0] for seed in range(40)}
    assert firsts == {"b", "c"}  # "a", the busiest, is never first: it always loses its pair
    assert rank_replicas(keys, [], imbalance=4) == []


def test_prompt_keys_follow_shared_prefixes_as_the_store_does():
    from kvboost_hf.cluster.routing import Keying
    from kvboost_hf.store.scope import CacheScope

    keying = Keying(NS, 8, turn_tokens=(21,))
    alice = CacheScope(owner="alice", shared_salt="shared")
    bob = CacheScope(owner="bob", shared_salt="shared")
    system = TOKENS[:16]
    store = ChunkStore(max_bytes=10**6, chunk_size=8)
    shared_root = CacheScope(salt="shared").root(NS)
    store.insert(shared_root, system, fake_states(system), boundaries=keying.prompt_keys(system).bounds)
    store.insert(alice.root(NS), TOKENS, fake_states(TOKENS), boundaries=keying.prompt_keys(TOKENS).bounds,
                 shared=alice.shared_root(NS))
    ends = store.chain_ends(shared_root)
    assert ends == {16}
    hits = store.lookup(alice.root(NS), TOKENS, shared=alice.shared_root(NS))
    assert len(hits) == len(store.entries()) == 5  # 3 shared chunks (the last ends with the system text), 2 own
    assert keying.prompt_keys(TOKENS, alice).matched(held(store), ends) == 5
    assert keying.prompt_keys(TOKENS, alice).matched(held(store)) == 2  # not told where the shared text ends
    assert keying.prompt_keys(TOKENS, bob).matched(held(store), ends) == 3  # bob: the shared chunks only
    assert keying.prompt_keys(TOKENS, CacheScope(owner="alice")).matched(held(store), ends) == 0  # no shared root
    assert Keying.from_dict(keying.as_dict()) == keying
