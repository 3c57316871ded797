"""The Redis tier against a real redis-server: sharing across replicas, precision, corruption, auth (outages:
test_remote_outages.py)."""

from __future__ import annotations

import logging
import uuid

import pytest
import redis
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.store.remote_guard import redact
from tests.conftest import make_tiny, random_ids, start_redis
from tests.store.test_store import NS, fake_states, put

TOKENS = list(range(10, 22))  # three 4-token chunks


def replica(url: str, prefix: str, **kw) -> ChunkStore:
    kw.setdefault("chunk_size", 4)
    return ChunkStore(remote=url, remote_prefix=prefix, **kw)


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def blob_names(url, prefix, bits="none"):
    return sorted(k.decode() for k in redis.Redis.from_url(url).keys(f"{prefix}:kv:{bits}:*"))


def test_a_replica_reuses_what_another_stored(redis_url, prefix):
    first = replica(redis_url, prefix)
    put(first, TOKENS)
    assert first.flush()
    second = replica(redis_url, prefix)
    hits = second.lookup(NS, TOKENS)
    assert [h.num_tokens for h in hits] == [4, 4, 4]
    for mine, theirs in zip(hits, first.lookup(NS, TOKENS)):
        for layer in range(2):
            assert all(torch.equal(a, b) for a, b in zip(mine.layer_states(layer), theirs.layer_states(layer)))
    stats = second.stats()
    assert stats["remote"]["hits"] == 3 and stats["entries"] == 3  # promoted to RAM
    assert sum(h.num_tokens for h in second.lookup(NS, TOKENS[:10])) == 10  # now from RAM, token granular
    assert second.stats()["remote"]["reads"] == 3
    ttl = redis.Redis.from_url(redis_url).ttl(blob_names(redis_url, prefix)[0])
    assert 0 < ttl <= 7 * 24 * 3600


def test_partial_chain_and_other_prefixes_stay_apart(redis_url, prefix):
    tokens = list(range(10, 42))  # two 16-token chunks
    writer = replica(redis_url, prefix, chunk_size=16)
    put(writer, tokens)
    assert writer.flush()
    # Successors are indexed by their first 8 tokens: a prompt leaving the chain after them still hits.
    partial = replica(redis_url, prefix, chunk_size=16).lookup(NS, tokens[:27] + [99, 98])
    assert [h.num_tokens for h in partial] == [16, 11]
    early = replica(redis_url, prefix, chunk_size=16).lookup(NS, tokens[:20] + [99] * 10)
    assert [h.num_tokens for h in early] == [16]  # left within the anchor: that chunk is not found remotely
    assert replica(redis_url, prefix + "-other", chunk_size=16).lookup(NS, tokens) == []


def test_lossless_store_never_takes_lossy_entries(redis_url, prefix):
    quantized = replica(redis_url, prefix, kv_bits=4)
    put(quantized, TOKENS)
    quantized.flush()
    lossless = replica(redis_url, prefix)
    assert lossless.lookup(NS, TOKENS) == []
    put(lossless, TOKENS)
    lossless.flush()
    hits = replica(redis_url, prefix, kv_bits=4).lookup(NS, TOKENS)  # quantized stores take lossless ones
    assert len(hits) == 3 and all(h.chunk.bits is None for h in hits)
    assert replica(redis_url, prefix).stats()["remote"]["corrupt_dropped"] == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_corrupt_or_swapped_values_are_dropped_never_loaded(redis_url, prefix, damage):
    writer = replica(redis_url, prefix)
    put(writer, TOKENS)
    writer.flush()
    client = redis.Redis.from_url(redis_url)
    keys = [h.chunk.key.hex() for h in writer.lookup(NS, TOKENS)]
    second, third = (f"{prefix}:kv:none:{k}" for k in keys[1:])
    data = client.get(second)
    if damage == "flip":
        data = data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = client.get(third)  # another chunk's blob under this chunk's name
    client.set(second, data)
    reader = replica(redis_url, prefix)
    assert sum(h.num_tokens for h in reader.lookup(NS, TOKENS)) == 4
    assert reader.stats()["remote"]["corrupt_dropped"] == 1 and not client.exists(second)


def test_password_urls_work_and_never_reach_the_logs(caplog):
    proc, url = start_redis(password="s3cret-pw")
    try:
        store = ChunkStore(chunk_size=4, remote=url, remote_prefix="auth")
        put(store, TOKENS)
        assert store.flush() and len(replica(url, "auth").lookup(NS, TOKENS)) == 3
        wrong = url.replace("s3cret-pw", "wrong-pw")
        with caplog.at_level(logging.WARNING):
            intruder = ChunkStore(chunk_size=4, remote=wrong, remote_prefix="auth")
            assert intruder.lookup(NS, TOKENS) == [] and intruder.stats()["remote"]["errors"] == 1
            assert "s3cret-pw" not in repr(store) and "wrong-pw" not in repr(intruder)
        assert caplog.records and not any("pw" in r.getMessage() for r in caplog.records)
        admin = redis.Redis.from_url(url)
        admin.acl_setuser("alice", enabled=True, passwords=["+alice-pw"], keys=["auth:*"], commands=["+@all"])
        acl_url = url.replace(":s3cret-pw@", "alice:alice-pw@")
        assert len(ChunkStore(chunk_size=4, remote=acl_url, remote_prefix="auth").lookup(NS, TOKENS)) == 3
    finally:
        proc.kill()
        proc.wait()


def test_bad_remote_settings_are_clear_errors():
    with pytest.raises(ValueError, match="Redis URL") as err:
        ChunkStore(remote="http://user:topsecret@host")
    assert "topsecret" not in str(err.value)
    with pytest.raises(ValueError, match="remote_timeout_s"):
        ChunkStore(remote="redis://127.0.0.1:1/0", remote_timeout_s=0)
    assert redact("redis://alice:pw@h:6379/0") == "redis://alice:***@h:6379/0"


# ---------------------------------------------------------------------- two replicas of a model
def chat_turns(seed: int = 40):
    turn1 = random_ids(30, seed)
    return turn1, lambda reply: torch.cat([reply, random_ids(8, seed + 1)], dim=1)


def test_conversation_continues_on_another_replica_with_identical_output(redis_url, prefix):
    replica_a, replica_b = make_tiny("llama"), make_tiny("llama")  # same weights, separate processes' worth of state
    turn1, follow_up = chat_turns()
    enable_chunk_reuse(replica_a, ChunkStore(max_bytes=10**8, chunk_size=8, remote=redis_url, remote_prefix=prefix))
    reply = replica_a.generate(turn1, max_new_tokens=6, do_sample=False)
    replica_a.__dict__["_kvboost_reuse"].store.flush()
    turn2 = follow_up(reply)
    ref = replica_b.generate(turn2, max_new_tokens=6, do_sample=False)
    enable_chunk_reuse(replica_b, ChunkStore(max_bytes=10**8, chunk_size=8, remote=redis_url, remote_prefix=prefix))
    out = replica_b.generate(turn2, max_new_tokens=6, do_sample=False)
    stats = last_request_stats(replica_b)
    disable_chunk_reuse(replica_a)
    disable_chunk_reuse(replica_b)
    assert torch.equal(out, ref)
    assert stats.exact_tokens >= turn1.shape[1] and stats.approximate_tokens == 0


def test_a_successor_whose_blob_is_gone_is_a_plain_miss(redis_url, prefix):
    writer = replica(redis_url, prefix)
    put(writer, TOKENS)
    assert writer.flush()
    client = redis.Redis.from_url(redis_url)
    last = f"{prefix}:kv:none:{writer.lookup(NS, TOKENS)[2].chunk.key.hex()}"
    client.delete(last)  # evicted or expired by Redis; its parent's successor list still names it
    reader = replica(redis_url, prefix)
    assert sum(h.num_tokens for h in reader.lookup(NS, TOKENS)) == 8
    assert reader.stats()["remote"]["corrupt_dropped"] == 0 and reader.stats()["remote"]["errors"] == 0


# ---------------------------------------------------------------------- what an adversarial review found
def test_a_forged_successor_entry_never_changes_output(redis_url, prefix):
    """The successor index is a hint: the matched length comes from the verified blob's own tokens."""
    import json

    from kvboost_hf.models.namespace import namespace

    model = make_tiny("llama")
    a, b1, b2, tail = random_ids(16, 1), random_ids(16, 2), random_ids(16, 3), random_ids(4, 9)
    first, second = torch.cat([a, b1, tail], 1), torch.cat([a, b2, tail], 1)
    ref = model.generate(second, max_new_tokens=8, do_sample=False)
    writer = ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix)
    enable_chunk_reuse(model, writer)
    model.generate(first, max_new_tokens=1, do_sample=False)
    assert writer.flush()
    client = redis.Redis.from_url(redis_url)
    root = writer.lookup(namespace(model), a[0].tolist())[0].chunk.key
    genuine = next(iter(client.hgetall(next(iter(client.keys(f"{prefix}:next:{root.hex()}:*"))))))
    # An entry filed where b2's continuation would be looked up, claiming b1's chunk holds b2's tokens.
    index = writer._remote._next(root, tuple(b2[0].tolist()))
    client.hset(index, genuine, json.dumps(b2[0].tolist()))
    reader = ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix)
    enable_chunk_reuse(model, reader)
    out = model.generate(second, max_new_tokens=8, do_sample=False)
    stats = last_request_stats(model)
    disable_chunk_reuse(model)
    assert torch.equal(out, ref) and stats.reused_tokens == 16
    assert not client.hexists(index, genuine)  # the lying entry is dropped


def test_malformed_index_entries_and_crafted_headers_are_dropped(redis_url, prefix, tmp_path):
    import json
    import os
    import struct

    from kvboost_hf.models.namespace import namespace

    model = make_tiny("llama")
    store = ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix)
    enable_chunk_reuse(model, store)
    ids = random_ids(40, 1)
    anchor_key = store._remote._next(namespace(model), tuple(ids[0].tolist()))
    redis.Redis.from_url(redis_url).hset(anchor_key, "ab" * 16, "5")  # not a list of token ids
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == 42
    disable_chunk_reuse(model)
    key = os.urandom(16).hex()
    header = json.dumps({"__metadata__": {"format": "kvboost-chunk-1", "key": key, "parent": key, "namespace": key,
                                          "tokens": "7"}}).encode()
    (tmp_path / f"{key}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (tmp_path / f"{'cd' * 16}.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    disk = ChunkStore(chunk_size=16, disk_path=tmp_path)
    assert disk.stats()["corrupt_dropped"] == 2 and disk.stats()["disk_entries"] == 0


def test_hits_keep_their_successor_index_alive(redis_url, prefix):
    writer = replica(redis_url, prefix)
    put(writer, TOKENS)
    assert writer.flush()
    client = redis.Redis.from_url(redis_url)
    for name in client.keys(f"{prefix}:next:*"):
        client.expire(name, 5)
    assert len(replica(redis_url, prefix).lookup(NS, TOKENS)) == 3
    assert all(client.ttl(name) > 3600 for name in client.keys(f"{prefix}:next:*"))


def test_pending_writes_are_bounded_in_bytes(redis_url, prefix, monkeypatch):
    import threading

    from kvboost_hf.store import remote as remote_module

    gate = threading.Event()
    real_write = remote_module.RemoteTier._write
    monkeypatch.setattr(remote_module.RemoteTier, "_write", lambda self, *a: (gate.wait(30), real_write(self, *a)))
    store = ChunkStore(chunk_size=4, remote=redis_url, remote_prefix=prefix)
    store._remote.max_pending_bytes = 500  # a fake chunk here holds 2 layers x K/V x 4 tokens x 4 x 4 bytes = 256
    for i in range(6):
        put(store, [60 + i] + TOKENS[:3])
    remote = store.stats()["remote"]
    assert remote["pending_bytes"] <= 500 and remote["writes_dropped"] >= 4
    gate.set()
    assert store.flush() and store.stats()["remote"]["pending_bytes"] == 0


def test_chunks_promoted_from_redis_are_written_to_the_disk_tier(redis_url, prefix, tmp_path):
    model = make_tiny("llama")
    history = random_ids(40, 1)
    first = ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix)
    enable_chunk_reuse(model, first)
    model.generate(history, max_new_tokens=2, do_sample=False)
    assert first.flush()
    enable_chunk_reuse(model, ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix, disk_path=tmp_path))
    longer = torch.cat([history, random_ids(60, 2)], 1)
    model.generate(longer, max_new_tokens=2, do_sample=False)
    enable_chunk_reuse(model, ChunkStore(chunk_size=16, disk_path=tmp_path))  # restarted, no Redis
    model.generate(longer, max_new_tokens=2, do_sample=False)
    reused = last_request_stats(model).reused_tokens
    disable_chunk_reuse(model)
    assert reused == 99


def test_redaction_covers_query_passwords_and_keeps_hosts():
    assert "s3cret" not in redact("redis://127.0.0.1:1/0?password=s3cret") and "127.0.0.1:1" in redact(
        "redis://127.0.0.1:1/0?password=s3cret")
    assert redact("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"
    assert redact("unix://:pw@/run/redis.sock?db=0") == "unix://:***@/run/redis.sock?db=0"
    store = ChunkStore(remote="redis://127.0.0.1:1/0?password=s3cret")
    assert "s3cret" not in repr(store)


def test_a_chain_that_starts_with_a_lone_bos_chunk_is_shared(redis_url, prefix):
    from kvboost_hf import warm

    model = make_tiny("llama")
    ids = torch.cat([torch.tensor([[1]]), random_ids(40, 5)], dim=1)  # warm() starts a chunk after <bos>
    writer = ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix)
    warm(model, ids, writer)
    assert writer.flush()
    enable_chunk_reuse(model, ChunkStore(chunk_size=16, remote=redis_url, remote_prefix=prefix))
    model.generate(torch.cat([ids, random_ids(3, 6)], dim=1), max_new_tokens=2, do_sample=False)
    reused = last_request_stats(model).reused_tokens
    disable_chunk_reuse(model)
    assert reused == 41


def test_a_conversation_that_moves_between_replicas_keeps_its_whole_history(redis_url, prefix):
    """Turns alternate between two replicas. Each turn's sequence ends in a short chunk, and the next
    turn's prompt runs on past it: the replica that served an earlier turn holds that short chunk
    (or a sibling matching a few tokens), while Redis holds the other replica's longer sibling and
    its successors. The lookup takes the longer chain."""
    a, b = replica(redis_url, prefix), replica(redis_url, prefix)
    other = list(range(10, 12)) + [500, 501, 502, 503]  # another chat: its 2nd chunk shares one token
    put(b, other)
    turns = [list(range(10, 21))]  # 11 tokens: chunks of 4, 4 and a short one of 3
    for extra in range(3):
        turns.append(turns[-1] + [100 + 10 * extra + i for i in range(6)])
    served_by = [a, b, a, b]
    for turn, (tokens, store) in enumerate(zip(turns, served_by)):
        hits = store.lookup(NS, tokens)
        reused = sum(h.num_tokens for h in hits)
        assert reused == (0 if turn == 0 else len(turns[turn - 1])), (turn, [(h.start, h.num_tokens) for h in hits])
        put(store, tokens)
        assert store.flush()
    assert a.stats()["remote"]["hits"] > 0 and b.stats()["remote"]["hits"] > 0


def test_a_local_chain_redis_cannot_improve_on_reads_no_blob(redis_url, prefix):
    writer = replica(redis_url, prefix)
    put(writer, TOKENS[:10])  # ends in a short chunk of 2, also written to Redis
    assert writer.flush()
    hits = writer.lookup(NS, TOKENS[:10] + [99, 98])
    assert sum(h.num_tokens for h in hits) == 10
    assert writer.stats()["remote"]["reads"] == 0  # the index offered only the same chunk: nothing read


def test_a_short_chunk_inside_the_local_chain_never_trades_it_for_a_remote_sibling(redis_url, prefix):
    """Locally the prompt is chunked at a segment boundary (a short chunk of 2, then 12 more tokens);
    Redis holds the same tokens chunked without it (a first chunk of 4 that goes further than the
    short one). The longest local chain wins: match_path chose it, the sibling is never read."""
    tokens = list(range(10, 26))  # 16 tokens
    elsewhere = replica(redis_url, prefix)
    put(elsewhere, tokens[:6] + [99, 98])  # chunks [10..13] [14, 15, 99, 98]: a sibling of the short chunk
    assert elsewhere.flush()
    local = replica(redis_url, prefix)
    local.insert(NS, tokens, fake_states(tokens), boundaries=[2])  # [10, 11] [12..15] [16..19] [20..23] [24, 25]
    calls = []
    original = local._remote.successors
    local._remote.successors = lambda *a: calls.append(a) or original(*a)
    hits = local.lookup(NS, tokens + [7])
    assert [(h.start, h.num_tokens) for h in hits] == [(0, 2), (2, 4), (6, 4), (10, 4), (14, 2)]
    assert local.stats()["remote"]["reads"] == 0
    assert len(calls) <= 2  # one sibling query for the path's last (short) chunk, one for its successors


def test_a_short_last_chunk_with_successors_in_redis_keeps_them_before_any_sibling(redis_url, prefix):
    """Locally only a lone BOS chunk matches. Redis holds the prompt's own chain after a lone BOS
    (13 tokens) and a sibling of the BOS chunk that claims 4 tokens and then leaves the prompt. The
    lookup follows the BOS chunk's successors, as before; the sibling would have ended it at 4."""
    bos, text = [1], list(range(10, 22))
    chained = replica(redis_url, prefix)
    chained.insert(NS, bos + text, fake_states(bos + text), boundaries=[1])  # [1] [10..13] [14..17] [18..21]
    unchained = replica(redis_url, prefix)
    put(unchained, bos + text[:3] + [90, 91])  # [1, 10, 11, 12] [90, 91]
    assert chained.flush() and unchained.flush()
    local = replica(redis_url, prefix)
    local.insert(NS, bos + [50, 51, 52, 53], fake_states(bos + [50, 51, 52, 53]), boundaries=[1])
    hits = local.lookup(NS, bos + text)
    assert [(h.start, h.num_tokens) for h in hits] == [(0, 1), (1, 4), (5, 4), (9, 4)]
