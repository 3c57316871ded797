"""Prompt logprobs (echo + logprobs) under tenants: a purge on another replica reaches logprobs the store
holds whole, and one tenant's scoring never changes what another's reports over shared chunks."""

from __future__ import annotations

import uuid

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, warm
from kvboost_hf.server.decoding.logprobs import prompt_logprobs
from kvboost_hf.server.routes.tenancy import SHARED_SALT as SHARED
from kvboost_hf.store.scope import CacheScope
from tests.conftest import make_tiny, random_ids


def test_prompt_logprobs_on_another_replica_ignore_a_purge(redis_url):
    """echo+logprobs whose logprobs the store holds never forwards, so start_request (and its follow_purges)
    never runs: replica 1 keeps serving the purged tenant's stored logprobs (cached_tokens = whole prompt)
    after replica 2 purged the tenant."""
    prefix = f"r-{uuid.uuid4().hex[:8]}"
    one = ChunkStore(max_bytes=50_000_000, chunk_size=16, remote=redis_url, remote_prefix=prefix)
    two = ChunkStore(max_bytes=50_000_000, chunk_size=16, remote=redis_url, remote_prefix=prefix)
    model = make_tiny("llama", seed=5)
    enable_chunk_reuse(model, one)
    try:
        ids = random_ids(64, seed=9)[0].tolist()
        scope = CacheScope(owner="a")
        prompt_logprobs(model, ids, 0, one, scope=scope)
        assert prompt_logprobs(model, ids, 0, one, scope=scope).cached_tokens == len(ids)
        assert one.flush()
        assert two.purge("a")["remote"] is not None  # DELETE /v1/cache answered by replica 2
        again = prompt_logprobs(model, ids, 0, one, scope=CacheScope(owner="a"))
        assert again.cached_tokens == 0, "purged logprobs served by replica 1"
    finally:
        disable_chunk_reuse(model)


def bob_cached_tokens(alice_scored_first: bool) -> int:
    model = make_tiny("llama", seed=4)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(model, store)
    try:
        system = random_ids(32, 7)[0].tolist()  # four whole shared chunks
        warm(model, system, cache_salt=CacheScope(salt=SHARED))  # the admin's "shared": true warm
        if alice_scored_first:
            prompt_logprobs(model, system + random_ids(10, 8)[0].tolist(), 0, store,
                            scope=CacheScope(owner="alice", shared_salt=SHARED, epoch=0))
        bob = system + random_ids(10, 9)[0].tolist()
        return prompt_logprobs(model, bob, 0, store,
                               scope=CacheScope(owner="bob", shared_salt=SHARED, epoch=0)).cached_tokens
    finally:
        disable_chunk_reuse(model)


def test_bobs_echo_logprobs_do_not_depend_on_alices_activity():
    alone, after_alice = bob_cached_tokens(False), bob_cached_tokens(True)
    assert alone == after_alice, f"bob's cached_tokens {alone} alone vs {after_alice} after alice's echo request"
