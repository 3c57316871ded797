"""The Redis tier against a real redis-server: sharing across replicas, precision, corruption, outages, auth."""

from __future__ import annotations

import logging
import socket
import uuid

import pytest
import redis
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.store.remote import CircuitBreaker, redact
from tests.conftest import make_tiny, random_ids, start_redis
from tests.store.test_store import NS, put

TOKENS = list(range(10, 22))  # three 4-token chunks


def replica(url: str, prefix: str, **kw) -> ChunkStore:
    return ChunkStore(chunk_size=4, remote=url, remote_prefix=prefix, **kw)


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
    writer = replica(redis_url, prefix)
    put(writer, TOKENS)
    assert writer.flush()
    assert sum(h.num_tokens for h in replica(redis_url, prefix).lookup(NS, TOKENS[:6] + [99, 98])) == 6
    assert replica(redis_url, prefix + "-other").lookup(NS, TOKENS) == []


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


def test_unreachable_redis_costs_nothing_but_speed():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens there
    store = ChunkStore(chunk_size=4, remote=f"redis://127.0.0.1:{port}/0")
    for i in range(5):
        tokens = [50 + i] + TOKENS
        put(store, tokens)
        assert sum(h.num_tokens for h in store.lookup(NS, tokens)) == len(tokens)  # RAM still serves
        assert store.lookup(NS, [7, 7, 7, 7, 7]) == []
    remote = store.stats()["remote"]
    assert remote["errors"] == 1 and remote["skipped"] > 0 and not remote["available"]  # the breaker held it off


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


def test_circuit_breaker_backs_off_and_recovers():
    now = [0.0]
    breaker = CircuitBreaker(backoff_s=2.0, max_backoff_s=5.0, clock=lambda: now[0])
    assert breaker.allow()
    assert breaker.failure() == 2.0 and not breaker.allow()
    now[0] = 2.5
    assert breaker.allow() and breaker.failure() == 4.0
    now[0] = 7.0
    assert breaker.failure() == 5.0  # capped
    now[0] = 12.5
    breaker.success()
    assert breaker.allow() and breaker.failure() == 2.0


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


def test_requests_still_succeed_when_redis_dies_mid_run():
    proc, url = start_redis()
    model = make_tiny("qwen2")
    prompts = [random_ids(30, 60 + i) for i in range(4)]
    refs = [model.generate(p, max_new_tokens=5, do_sample=False) for p in prompts]
    store = ChunkStore(max_bytes=10**8, chunk_size=8, remote=url, remote_prefix="dies")
    enable_chunk_reuse(model, store)
    try:
        outs = [model.generate(prompts[0], max_new_tokens=5, do_sample=False)]
        store.flush()
        proc.kill()
        proc.wait()
        outs += [model.generate(p, max_new_tokens=5, do_sample=False) for p in prompts[1:]]
        outs.append(model.generate(prompts[0], max_new_tokens=5, do_sample=False))
    finally:
        disable_chunk_reuse(model)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs + refs[:1]))
    remote = store.stats()["remote"]
    assert remote["writes"] >= 1 and remote["errors"] >= 1


def test_a_silent_redis_times_out_and_is_skipped():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        port = listener.getsockname()[1]
        store = ChunkStore(chunk_size=4, remote=f"redis://127.0.0.1:{port}/0", remote_timeout_s=0.1)
        put(store, TOKENS)
        assert store.flush(timeout_s=30)  # the first write times out; the breaker skips the others
        assert store.lookup(NS, [5] + TOKENS) == []
        assert sum(h.num_tokens for h in store.lookup(NS, TOKENS)) == 12
        remote = store.stats()["remote"]
        assert remote["errors"] == 1 and remote["skipped"] >= 3 and remote["write_errors"] == 3
    finally:
        listener.close()


def test_a_full_redis_refuses_writes_and_requests_carry_on():
    proc, url = start_redis()
    try:
        client = redis.Redis.from_url(url)
        client.set("ballast", b"x" * 2_000_000)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "1mb")  # over the limit already: every write is refused (OOM)
        store = ChunkStore(chunk_size=4, remote=url, remote_prefix="full")
        put(store, TOKENS)
        store.flush()
        assert sum(h.num_tokens for h in store.lookup(NS, TOKENS)) == 12
        assert store.stats()["remote"]["write_errors"] >= 1 and client.keys("full:*") == []
    finally:
        proc.kill()
        proc.wait()


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
