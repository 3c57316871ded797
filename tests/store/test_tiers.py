"""Every tier speaks the Tier protocol: write, has, read (verified, decoded), remove, stats, close."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore
from kvboost_hf.store.codec import StoredChunk, encode_chunk
from kvboost_hf.store.disk import DiskTier
from kvboost_hf.store.keys import chunk_key
from kvboost_hf.store.ram import RamTier
from kvboost_hf.store.remote import RemoteTier

NAMESPACE = b"\x07" * 16


def entry(seed: int, bits: int | None = None) -> StoredChunk:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(2, 8, 16, generator=g) for _ in range(2)]
    values = [torch.randn(2, 8, 16, generator=g) for _ in range(2)]
    tokens = tuple(range(seed, seed + 8))
    return StoredChunk(chunk_key(NAMESPACE, tokens), NAMESPACE, NAMESPACE, 0, tokens,
                       **encode_chunk(keys, values, bits, 16, 0))


@pytest.fixture(params=["ram", "disk", "remote"])
def tier(request, tmp_path):
    if request.param == "ram":
        yield RamTier(max_bytes=10**7, recency_half_life=256)
    elif request.param == "disk":
        yield DiskTier(tmp_path, max_bytes=10**7)
    else:
        url = request.getfixturevalue("redis_url")
        remote = RemoteTier(url, f"tiers-{tmp_path.name}")
        yield remote
        remote.close()


def test_a_tier_round_trips_an_entry(tier):
    e = entry(1)
    assert not tier.has(e.key) and tier.read(e.key, NAMESPACE) is None
    assert tier.write(e) is True
    if isinstance(tier, RemoteTier):
        assert tier.flush(10)
    assert tier.has(e.key)
    back = tier.read(e.key, NAMESPACE)
    assert back is not None and back.token_ids == e.token_ids
    for i in range(2):
        assert torch.equal(back.layer_states(i, 8)[0], e.layer_states(i, 8)[0])
    assert tier.read(e.key, b"\x08" * 16) is None  # another namespace's key: never served
    tier.remove(e.key)
    assert not tier.has(e.key) and tier.read(e.key, NAMESPACE) is None
    assert isinstance(tier.stats(), dict)
    tier.close()


def test_a_remote_tier_serves_only_precisions_its_store_accepts(redis_url, tmp_path):
    lossy = entry(2, bits=4)
    writer = RemoteTier(redis_url, f"prec-{tmp_path.name}")
    lossless = RemoteTier(redis_url, f"prec-{tmp_path.name}", accepts=lambda bits: bits is None)
    try:
        assert writer.write(lossy) and writer.flush(10)
        assert writer.read(lossy.key, NAMESPACE) is not None
        assert not lossless.has(lossy.key) and lossless.read(lossy.key, NAMESPACE) is None
    finally:
        writer.close()
        lossless.close()


def test_a_store_lists_its_tiers_nearest_first(tmp_path):
    assert [t.name for t in ChunkStore(max_bytes=10**7, chunk_size=8).tiers] == ["ram"]
    store = ChunkStore(max_bytes=10**7, chunk_size=8, disk_path=tmp_path)
    assert [t.name for t in store.tiers] == ["ram", "disk"]
