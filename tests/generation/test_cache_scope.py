"""CacheScope through generate and warm: owners never share, a shared prefix is read by every owner
(and what follows it stays each owner's), quotas and purges hold for entries stored by generate, and
every reply stays token-identical to plain generate."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from kvboost_hf.generation import reusable_tokens
from kvboost_hf.store.scope import CacheScope
from tests.conftest import make_tiny, random_ids

CHUNK = 8
SHARED = "company-system-prompt"


@pytest.fixture
def model():
    m = make_tiny("llama", seed=4)
    yield m
    disable_chunk_reuse(m)


def scope(owner, salt=None):
    return CacheScope(salt=salt, owner=owner, shared_salt=SHARED)


def run(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=4, do_sample=False, **kw)
    return out, last_request_stats(model)


def test_owners_share_the_shared_prefix_and_nothing_else(model, tmp_path):
    system = random_ids(21, 7)  # two whole chunks and a 5-token last one
    prompt = torch.cat([system, random_ids(19, 8)], dim=1)
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    store = ChunkStore(max_bytes=10**8, chunk_size=CHUNK, disk_path=tmp_path)
    enable_chunk_reuse(model, store)
    warm(model, system, cache_salt=CacheScope(salt=SHARED))
    out, stats = run(model, prompt, cache_salt=scope("alice"))
    assert torch.equal(out, expected) and stats.reused_tokens == 21
    out, stats = run(model, prompt, cache_salt=scope("alice"))
    assert torch.equal(out, expected) and stats.reused_tokens == 39  # all but the last prompt token
    out, stats = run(model, prompt, cache_salt=scope("bob"))
    assert torch.equal(out, expected) and stats.reused_tokens == 21  # never alice's continuation
    assert reusable_tokens(model, prompt[0].tolist(), cache_salt=scope("carol")) == 21
    out, stats = run(model, prompt, cache_salt=scope("alice", salt="other"))
    assert torch.equal(out, expected) and stats.reused_tokens == 21  # another salt of alice's: its own chain
    out, stats = run(model, prompt)
    assert torch.equal(out, expected) and stats.reused_tokens == 0  # no scope: neither shared nor owned entries
    store.clear()  # from disk now: the same answers
    assert reusable_tokens(model, prompt[0].tolist(), cache_salt=scope("alice")) == 40
    assert reusable_tokens(model, prompt[0].tolist(), cache_salt=scope("bob")) == 40  # bob stored his own
    assert reusable_tokens(model, prompt[0].tolist(), cache_salt=scope("dave")) == 21


def test_purge_and_quota_through_generate(model):
    store = ChunkStore(max_bytes=10**8, chunk_size=CHUNK)
    enable_chunk_reuse(model, store)
    prompts = [random_ids(48, 20 + k) for k in range(6)]
    run(model, prompts[0], cache_salt=scope("bob"))
    bob = store.owner_bytes()["bob"]
    store.set_quota("alice", bob)  # room for one prompt's entries
    for p in prompts[1:]:
        run(model, p, cache_salt=scope("alice"))
        assert store.owner_bytes()["alice"] <= bob
    assert store.owner_bytes()["bob"] == bob  # alice's traffic never evicted bob's
    _, stats = run(model, prompts[-1], cache_salt=scope("alice"))
    assert stats.reused_tokens > 0  # the newest of alice's stayed
    store.purge("alice")
    _, stats = run(model, prompts[-1], cache_salt=scope("alice"))
    assert stats.reused_tokens == 0
    _, stats = run(model, prompts[0], cache_salt=scope("bob"))
    assert stats.reused_tokens == 47
