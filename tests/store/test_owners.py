"""Owners in the store: roots per owner, shared chains read as a prefix, quotas in RAM and on disk,
purges (RAM, disk, Redis with its queued writes) and the purge epoch that drops what a purge overtook."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import owned, salted
from kvboost_hf.store.scope import CacheScope, as_scope
from tests.store.test_store import NS, fake_states

SHARED = salted(NS, "shared")
A, B = owned(NS, "a"), owned(NS, "b")
TOKENS = list(range(10, 30))  # five 4-token chunks


def insert(store, root, tokens, owner=None, **kw):
    return store.insert(root, tokens, fake_states(tokens), owner=owner, **kw)


def reused(store, root, tokens, **kw) -> int:
    return sum(h.num_tokens for h in store.lookup(root, tokens, **kw))


def test_scope_roots_differ_by_salt_and_by_owner_and_never_collide():
    roots = {CacheScope().root(NS), CacheScope(salt="x").root(NS), CacheScope(owner="x").root(NS),
             CacheScope(salt="x", owner="x").root(NS), CacheScope(salt="x", owner="y").root(NS)}
    assert len(roots) == 5
    assert CacheScope(shared_salt="s").shared_root(NS) == salted(NS, "s") and CacheScope().shared_root(NS) is None
    assert as_scope("x") == CacheScope(salt="x") and as_scope(None) is None
    for bad, error in ((3, TypeError), ("", ValueError)):
        with pytest.raises(error):
            as_scope(bad)
    with pytest.raises(ValueError, match="shared_salt equals"):
        CacheScope(salt="s", shared_salt="s")
    with pytest.raises(TypeError):
        CacheScope(owner=1)


def test_shared_chunks_are_read_then_the_chain_goes_on_under_the_requests_own_root():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    system = TOKENS[:10]  # two whole chunks and a 2-token final one
    insert(store, SHARED, system)
    prompt = TOKENS
    assert reused(store, A, prompt, shared=SHARED) == 10  # the shared prefix, its short last chunk included
    assert reused(store, A, prompt) == 0  # not without shared=
    added = insert(store, A, prompt, owner="a", shared=SHARED)
    assert added == 3  # only what follows the shared chunks: 10 + 4 + 4 + 2
    assert all(e.owner == "a" for e in store.entries() if e.start >= 10)
    assert reused(store, A, prompt, shared=SHARED) == 20
    assert reused(store, B, prompt, shared=SHARED) == 10  # b reads the shared prefix, never a's continuation
    assert store.stored_prefix_length(A, prompt, shared=SHARED) == 20
    assert store.stored_prefix_length(B, prompt, shared=SHARED) == 10
    # A prompt leaving the shared text inside a chunk: the partial shared hit, nothing of a's.
    assert reused(store, B, system[:6] + [99, 98], shared=SHARED) == 6
    # What b stores after the shared prefix is b's alone.
    insert(store, B, prompt, owner="b", shared=SHARED)
    hits = store.lookup(B, prompt, shared=SHARED)
    assert [h.chunk.owner for h in hits] == [None, None, None, "b", "b", "b"]


def test_a_quota_evicts_only_its_owners_entries():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    insert(store, B, TOKENS, owner="b")
    insert(store, NS, TOKENS)
    before = {e.key for e in store.entries() if e.owner != "a"}
    one = store.entries()[0].nbytes
    store.set_quota("a", 3 * one)
    for k in range(6):
        insert(store, A, [100 + 10 * k + i for i in range(8)], owner="a")
        assert store.owner_bytes()["a"] <= 3 * one
    assert {e.key for e in store.entries() if e.owner != "a"} == before
    assert store.stats()["evictions"] > 0
    assert store.quotas() == {"a": 3 * one}
    store.set_quota("a", None)
    assert store.quotas() == {}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="quota"):
            store.set_quota("a", bad)
    with pytest.raises(ValueError, match="owner"):
        store.set_quota("", 10)


def test_over_the_budget_owners_without_a_quota_go_first():
    probe = ChunkStore(max_bytes=10**6, chunk_size=4)
    insert(probe, NS, TOKENS[:4])
    one = probe.entries()[0].nbytes
    store = ChunkStore(max_bytes=10 * one, chunk_size=4)
    store.set_quota("a", 5 * one)
    store.set_quota("b", 5 * one)
    insert(store, A, TOKENS, owner="a")
    insert(store, B, TOKENS, owner="b")
    quota_keys = {e.key for e in store.entries()}
    assert len(quota_keys) == 10  # both quotas are full, the store too
    for k in range(5):  # heavy traffic of an owner without a quota
        insert(store, owned(NS, "c"), [200 + 10 * k + i for i in range(8)], owner="c")
    assert quota_keys <= {e.key for e in store.entries()}  # nobody with a quota lost anything
    assert store.stats()["rejected"] > 0  # c found no room of its own: refused, not taken from a or b
    assert store.nbytes <= store.max_bytes


def test_disk_quota_keeps_the_owners_files_under_it_and_others_untouched(tmp_path):
    store = ChunkStore(max_bytes=10**6, chunk_size=4, disk_path=tmp_path)
    insert(store, B, TOKENS, owner="b")
    b_files = set(store._disk.owned("b"))
    size = max(r.nbytes for r in store._disk.records(b_files))
    store.set_quota("a", 3 * size)
    for k in range(6):
        insert(store, A, [100 + 10 * k + i for i in range(8)], owner="a")
    a_bytes = sum(r.nbytes for r in store._disk.records(set(store._disk.owned("a"))))
    assert 0 < a_bytes <= 3 * size
    assert set(store._disk.owned("b")) == b_files


def test_purge_forgets_the_owner_in_ram_and_on_disk_and_nothing_else(tmp_path):
    store = ChunkStore(max_bytes=10**6, chunk_size=4, disk_path=tmp_path)
    insert(store, SHARED, TOKENS[:8])
    insert(store, A, TOKENS, owner="a", shared=SHARED)
    insert(store, B, TOKENS, owner="b", shared=SHARED)
    result = store.purge("a")
    assert result == {"ram": 3, "disk": 3, "remote": 0}
    assert reused(store, A, TOKENS, shared=SHARED) == 8  # the shared prefix only
    assert reused(store, B, TOKENS, shared=SHARED) == 20
    assert store._disk.owned("a") == []
    reopened = ChunkStore(max_bytes=10**6, chunk_size=4, disk_path=tmp_path)  # a restart finds nothing of a's
    assert reused(reopened, A, TOKENS, shared=SHARED) == 8
    assert reused(reopened, B, TOKENS, shared=SHARED) == 20


def test_an_insert_that_began_before_a_purge_stores_nothing():
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    epoch = store.epoch("a")
    store.purge("a")
    assert insert(store, A, TOKENS, owner="a", epoch=epoch) == 0
    assert insert(store, A, TOKENS, owner="a", epoch=store.epoch("a")) == 5
    assert insert(store, B, TOKENS, owner="b", epoch=store.epoch("b")) == 5  # b was never purged


def test_a_purge_racing_writes_leaves_nothing_of_what_began_before_it():
    store = ChunkStore(max_bytes=10**7, chunk_size=4)
    started = threading.Barrier(3, timeout=60)  # a writer that fails first breaks it: no hang
    epochs = []

    def writer(offset):
        epoch = store.epoch("a")
        epochs.append(epoch)
        started.wait()
        for k in range(40):
            tokens = [offset + 1000 * k + i for i in range(12)]
            insert(store, A, tokens, owner="a", epoch=epoch)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (10**6, 2 * 10**6)]
    for t in threads:
        t.start()
    started.wait()
    store.purge("a")
    for t in threads:
        t.join()
    assert epochs == [0, 0]
    assert store.owner_bytes().get("a", 0) == 0 and not [e for e in store.entries() if e.owner == "a"]


def test_two_replicas_on_one_redis_keep_owners_apart_and_a_purge_reaches_redis(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    first = ChunkStore(max_bytes=10**6, chunk_size=4, remote=redis_url, remote_prefix=prefix)
    second = ChunkStore(max_bytes=10**6, chunk_size=4, remote=redis_url, remote_prefix=prefix)
    insert(first, A, TOKENS, owner="a")
    insert(second, B, TOKENS, owner="b")
    assert first.flush() and second.flush()
    fresh = ChunkStore(max_bytes=10**6, chunk_size=4, remote=redis_url, remote_prefix=prefix)
    assert reused(fresh, A, TOKENS) == 20 and reused(fresh, B, TOKENS) == 20
    assert reused(fresh, NS, TOKENS) == 0 and reused(fresh, owned(NS, "c"), TOKENS) == 0
    # A purge on one replica deletes the owner's blobs and successor entries in Redis, queued writes first.
    insert(first, A, TOKENS[:4] + [77] * 8, owner="a")  # queued, maybe not yet written
    result = first.purge("a")
    assert result["remote"] == 7  # 5 + 2 blobs, whichever process wrote them
    client = redis.Redis.from_url(redis_url)
    tokens_left = b"".join(v for k in client.keys(f"{prefix}:next:*") for v in client.hvals(k))
    assert b"77" not in tokens_left
    later = ChunkStore(max_bytes=10**6, chunk_size=4, remote=redis_url, remote_prefix=prefix)
    assert reused(later, A, TOKENS) == 0
    assert reused(later, B, TOKENS) == 20
    for store in (first, second, fresh, later):
        store.close()


def test_a_purge_on_one_replica_reaches_the_others_ram(redis_url):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    one, two = (ChunkStore(max_bytes=10**6, chunk_size=4, remote=redis_url, remote_prefix=prefix) for _ in range(2))
    assert not one.follow_purges("a")  # the first look learns the count
    insert(one, A, TOKENS, owner="a")
    insert(one, B, TOKENS, owner="b")
    assert one.flush()
    assert two.purge("a")["remote"] == 5
    assert reused(one, A, TOKENS) == 20  # its RAM still holds them until it looks
    assert one.follow_purges("a") and reused(one, A, TOKENS) == 0
    assert reused(one, B, TOKENS) == 20
    assert not one.follow_purges("a")  # nothing new
    insert(one, A, TOKENS, owner="a")
    assert not two.follow_purges("a") and reused(one, A, TOKENS) == 20  # the purging replica is up to date
    for store in (one, two):
        store.close()


def test_a_purge_while_redis_is_down_says_so():
    store = ChunkStore(max_bytes=10**6, chunk_size=4, remote="redis://127.0.0.1:1/0", remote_timeout_s=0.05)
    insert(store, A, TOKENS, owner="a")
    result = store.purge("a", timeout_s=2.0)
    assert result["ram"] == 5 and result["remote"] is None
    store.close()
