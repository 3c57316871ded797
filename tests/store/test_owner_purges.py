"""Purges against the races an attacker or an outage brings: a lookup during a purge, another replica's
queued writes, a replica restarted after a purge, entries kept alive by reads, the owner index's size,
and the store-wide draft index (found by review; each failed before the fixes)."""
from __future__ import annotations

import threading
import time
import uuid

import redis

from kvboost_hf.speculative.lookup import store_ngrams
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.keys import owned
from tests.store.test_store import NS, fake_states

A, B = owned(NS, "a"), owned(NS, "b")
TOKENS = list(range(10, 30))  # five 4-token chunks


def insert(store, root, tokens, owner=None, **kw):
    return store.insert(root, tokens, fake_states(tokens), owner=owner, **kw)


def reused(store, root, tokens) -> int:
    return sum(h.num_tokens for h in store.lookup(root, tokens))


def replica(url, prefix, **kw):
    return ChunkStore(max_bytes=10**6, chunk_size=4, remote=url, remote_prefix=prefix, **kw)


def block_writer(store):
    """Make the store's Redis writer thread stop before its next write until the returned event is set."""
    gate = threading.Event()
    original = store._remote._write

    def gated(*args):
        gate.wait(30)
        original(*args)

    store._remote._write = gated
    return gate


def test_lookup_during_purge_repromotes_purged_redis_entries(redis_url):
    """A lookup (e.g. a request of the tenant already running) between the local purge and the queued Redis
    purge promotes the tenant's blobs from Redis back into RAM: they are served after DELETE returned."""
    store = replica(redis_url, f"r-{uuid.uuid4().hex[:8]}")
    insert(store, A, TOKENS, owner="a")
    assert store.flush()
    store.clear()  # RAM only (e.g. evicted): the entries live on in Redis
    gate = block_writer(store)
    insert(store, B, [7, 8, 9, 6], owner="b")  # any queued write: the purge waits behind it
    result = {}
    purger = threading.Thread(target=lambda: result.update(store.purge("a", timeout_s=30)))
    purger.start()
    deadline = time.monotonic() + 10
    while store.epoch("a") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.epoch("a") == 1  # the local tiers are purged; Redis' purge is queued
    reused(store, A, TOKENS)  # a request of tenant a, racing the purge
    gate.set()
    purger.join(30)
    assert result["remote"] is not None
    assert reused(store, A, TOKENS) == 0, "purged entries served after purge() returned"


def test_another_replicas_queued_writes_survive_a_purge(redis_url):
    """Writes queued on replica 1 (a request that began before the purge) land in Redis after replica 2
    purged the owner: every replica then serves the purged entries."""
    prefix = f"r-{uuid.uuid4().hex[:8]}"
    one, two = replica(redis_url, prefix), replica(redis_url, prefix)
    gate = block_writer(one)
    insert(one, A, TOKENS, owner="a")  # queued, not yet written
    assert two.purge("a")["remote"] is not None
    gate.set()
    assert one.flush()
    assert reused(replica(redis_url, prefix), A, TOKENS) == 0, "purged tenant's entries readable from Redis"


def test_restarted_replica_never_follows_a_purge_made_while_it_was_down(redis_url, tmp_path):
    """follow_purges' first look only learns the count ("this store holds nothing purged before it"), but a
    replica's disk tier outlives a restart: a purge made elsewhere meanwhile is never applied to it."""
    prefix = f"r-{uuid.uuid4().hex[:8]}"
    one = replica(redis_url, prefix, disk_path=tmp_path / "one")
    insert(one, A, TOKENS, owner="a")
    assert one.flush()
    one.close()
    del one  # replica 1 restarts; meanwhile tenant a purges through replica 2
    assert replica(redis_url, prefix).purge("a")["remote"] is not None
    restarted = replica(redis_url, prefix, disk_path=tmp_path / "one")
    restarted.follow_purges("a")  # what the tenant's next request does first
    assert reused(restarted, A, TOKENS) == 0, "purged entries served from the restarted replica's disk"


def test_owner_set_expires_while_blobs_are_kept_alive_by_reads(redis_url):
    """Reads refresh a blob's TTL (and its successor index) but not the owner set a purge reads: an entry
    read regularly outlives its owner set and survives the purge."""
    prefix = f"r-{uuid.uuid4().hex[:8]}"
    writer = replica(redis_url, prefix, remote_ttl_s=4)
    insert(writer, A, TOKENS, owner="a")
    assert writer.flush()
    # The tenant keeps using its prompt (fresh replicas read it from Redis) past the owner set's 4 s; each read
    # comes within 4 s of the last, with ~3 s to spare for a new replica and its lookup on a loaded host.
    for _ in range(6):
        time.sleep(0.9)
        assert reused(replica(redis_url, prefix, remote_ttl_s=4), A, TOKENS) == 20
    assert writer.purge("a")["remote"] is not None
    assert reused(replica(redis_url, prefix), A, TOKENS) == 0, "purged entries still in Redis"


def test_the_owner_index_in_redis_holds_only_what_may_still_live(redis_url):
    """Every write names its blob in the owner's sorted set, pruned of what expired: steady traffic
    does not grow it past one TTL's writes."""
    prefix = f"g-{uuid.uuid4().hex[:8]}"
    store = ChunkStore(max_bytes=10**7, chunk_size=4, remote=redis_url, remote_prefix=prefix, remote_ttl_s=1)
    client = redis.Redis.from_url(redis_url)
    for round_ in range(8):  # new prompts every 0.4 s, each blob lives 1 s
        tokens = [1000 + 100 * round_ + i for i in range(40)]
        store.insert(NS, tokens, fake_states(tokens))  # one tenant: owner None
        assert store.flush()
        time.sleep(0.4)
    (owned_set,) = client.keys(f"{prefix}:owned:*")
    assert client.zcard(owned_set) <= 2 * 10 * 4  # at most the 4 latest rounds' blobs and successor entries
    store.close()


def test_store_wide_draft_index_keeps_a_purged_tenants_text():
    """draft="store" proposes from an n-gram index per (store, root) that a purge never clears: after
    DELETE /v1/cache the tenant's purged prompts and replies are still drafted from (and sped up)."""
    store = ChunkStore(max_bytes=10**6, chunk_size=4)
    secret = list(range(100, 140))
    store.insert(A, secret, fake_states(secret), owner="a")
    assert store_ngrams(store, A).propose(secret[:10], 8) is not None  # indexed
    store.purge("a")
    assert store.entries() == []
    proposal = store_ngrams(store, A).propose(secret[:10], 8)
    assert proposal is None, f"purged text still drafted: {proposal}"
