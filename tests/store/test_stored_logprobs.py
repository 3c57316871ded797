"""Per-token logprobs kept with stored chunks: byte form, checksum, old blobs, attach / serve."""

from __future__ import annotations

import math

import pytest
import torch

from kvboost_hf import ChunkStore
from kvboost_hf.store.codec import StoredChunk, encode_chunk, from_tensors, to_tensors
from kvboost_hf.store.entry_bytes import CorruptEntry, decode_entry, encode_entry
from kvboost_hf.store.keys import chunk_key
from kvboost_hf.store.logprobs import attach_logprobs, stored_logprobs


def chunk(logprobs: torch.Tensor | None, tokens=tuple(range(5, 13))) -> StoredChunk:
    torch.manual_seed(0)
    keys, values = [torch.randn(1, len(tokens), 8)], [torch.randn(1, len(tokens), 8)]
    parent = b"\x01" * 16
    entry = StoredChunk(chunk_key(parent, tokens), parent, b"\x02" * 16, 0, tokens,
                        **encode_chunk(keys, values, None, None, 0))
    entry.logprobs = logprobs
    return entry


def test_logprobs_round_trip_through_the_blob_and_the_checksum_covers_them():
    values = torch.tensor([math.nan, -1.5, -0.25, -3.0, -0.5, -2.0, -1.0, -0.125])
    entry = chunk(values)
    blob = encode_entry(entry.key, *to_tensors(entry))
    back = from_tensors(entry.key, *decode_entry(entry.key, blob))
    assert torch.equal(back.logprobs.nan_to_num(9.0), values.nan_to_num(9.0))
    tampered = bytearray(blob)
    position = bytes(blob).rfind(torch.tensor([-0.125]).numpy().tobytes())  # the last logprob's bytes
    assert position > 0
    tampered[position + 3] ^= 0x01
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(entry.key, bytes(tampered))


def test_blobs_without_logprobs_stay_readable():
    entry = chunk(None)
    tensors, metadata = to_tensors(entry)
    assert "logprobs" not in tensors
    back = from_tensors(entry.key, *decode_entry(entry.key, encode_entry(entry.key, tensors, metadata)))
    assert back.logprobs is None and back.token_ids == entry.token_ids
    wrong = dict(tensors, logprobs=torch.zeros(3))  # a wrong shape is ignored, never served
    assert from_tensors(entry.key, wrong, metadata).logprobs is None


def test_attach_and_serve_along_the_prefix_chain(tiny_prompt_store):
    store, ns, ids = tiny_prompt_store
    assert stored_logprobs(store, ns, ids) == []
    values = [None, *[-0.5 - i / 100 for i in range(1, len(ids))]]
    assert attach_logprobs(store, ns, ids, values) == 3  # chunks of 16, 16 and the 8-token tail
    served = stored_logprobs(store, ns, ids)
    assert served[0] is None and served[1:] == pytest.approx(values[1:])
    assert attach_logprobs(store, ns, ids[:20], values[:20]) == 1  # the second chunk reaches past 20 tokens: kept as is
    assert stored_logprobs(store, ns, ids[:20]) == pytest.approx(served[:20], nan_ok=True)  # a partial chunk hit
    assert stored_logprobs(store, ns, [99, *ids[1:]]) == []  # another first token: another chain
    with pytest.raises(ValueError, match="logprobs for"):
        attach_logprobs(store, ns, ids, values[:-1])


@pytest.fixture
def tiny_prompt_store():
    """A store holding the chunks (16 + 16 + 8 tokens) of a 40-token prompt of a tiny Llama."""
    from kvboost_hf import disable_chunk_reuse, enable_chunk_reuse
    from kvboost_hf.models.namespace import namespace
    from tests.conftest import make_tiny

    model = make_tiny("llama", seed=1)
    store = ChunkStore(max_bytes=10_000_000, chunk_size=16)
    enable_chunk_reuse(model, store)
    ids = list(range(3, 43))
    model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
    yield store, namespace(model), ids
    disable_chunk_reuse(model)


def test_attached_logprobs_reach_the_disk_tier(tmp_path):
    from kvboost_hf import disable_chunk_reuse, enable_chunk_reuse
    from kvboost_hf.models.namespace import namespace
    from tests.conftest import make_tiny

    model = make_tiny("llama", seed=1)
    store = ChunkStore(max_bytes=10_000_000, chunk_size=16, disk_path=tmp_path)
    enable_chunk_reuse(model, store)
    try:
        ids = list(range(3, 43))
        model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
        ns = namespace(model)
        values = [None, *[-1.0 - i / 64 for i in range(1, len(ids))]]
        assert attach_logprobs(store, ns, ids, values) == 3
        store.flush()
        reopened = ChunkStore(max_bytes=10_000_000, chunk_size=16, disk_path=tmp_path)  # RAM empty: files only
        served = stored_logprobs(reopened, ns, ids)
        assert served[0] is None and served[1:] == pytest.approx(values[1:])
    finally:
        disable_chunk_reuse(model)


def test_attached_logprobs_reach_another_replica_through_redis(redis_url):
    """Chunks go to Redis when stored, before any logprob is known; attaching rewrites the copies."""
    import uuid

    from kvboost_hf import disable_chunk_reuse, enable_chunk_reuse
    from kvboost_hf.models.namespace import namespace
    from tests.conftest import make_tiny

    prefix = f"lp-{uuid.uuid4().hex[:8]}"
    model = make_tiny("llama", seed=1)
    store = ChunkStore(max_bytes=10_000_000, chunk_size=16, remote=redis_url, remote_prefix=prefix)
    enable_chunk_reuse(model, store)
    try:
        ids = list(range(3, 43))
        model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
        ns = namespace(model)
        assert store.flush()
        before = ChunkStore(max_bytes=10_000_000, chunk_size=16, remote=redis_url, remote_prefix=prefix)
        assert stored_logprobs(before, ns, ids) == []  # the first copies carry none
        values = [None, *[-2.0 - i / 64 for i in range(1, len(ids))]]
        assert attach_logprobs(store, ns, ids, values) == 3
        assert store.flush()
        replica = ChunkStore(max_bytes=10_000_000, chunk_size=16, remote=redis_url, remote_prefix=prefix)
        served = stored_logprobs(replica, ns, ids)
        assert served[0] is None and served[1:] == pytest.approx(values[1:])
        for other in (before, replica):
            other.close()
    finally:
        store.close()
        disable_chunk_reuse(model)


def test_a_store_full_of_chunks_stays_in_budget_when_logprobs_are_attached(tiny_prompt_store):
    from kvboost_hf.store.codec import ENTRY_OVERHEAD_BYTES

    store, ns, ids = tiny_prompt_store
    held = store.nbytes
    for entry in store.entries():  # K/V, then per token its id (8 bytes) and a logprob slot (4), then overhead
        kv = sum(t.numel() * t.element_size() for t in (*entry.keys, *entry.values))
        assert entry.nbytes == kv + 12 * entry.num_tokens + ENTRY_OVERHEAD_BYTES
    attach_logprobs(store, ns, ids, [None, *[-1.0] * (len(ids) - 1)])
    assert sum(e.logprobs.numel() * 4 for e in store.entries()) == 4 * len(ids)
    assert store.nbytes == held  # nothing uncounted was added
