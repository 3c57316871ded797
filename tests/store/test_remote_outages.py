"""The Redis tier when Redis fails: unreachable, silent, full, killed mid-run; the circuit breaker that holds it off
and the log lines an outage leaves. A remote tier that is down costs speed, never a failed request."""

from __future__ import annotations

import logging
import socket

import redis
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
from kvboost_hf.store.remote_guard import CircuitBreaker
from tests.conftest import make_tiny, random_ids, start_redis
from tests.store.test_remote import TOKENS
from tests.store.test_store import NS, put


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

def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    """Retries during an outage (every health check, every lookup after the back-off) are debug lines:
    a store left pointing at a stopped Redis must not fill the log."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = ChunkStore(chunk_size=4, remote=f"redis://127.0.0.1:{port}/0")
    tier = store._remote
    with caplog.at_level(logging.DEBUG, logger="kvboost_hf.store.remote"):
        for _ in range(3):
            tier.breaker.open_until = 0.0  # the back-off elapsed
            assert tier.check() is False
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
        # Our three checks, and any the tier's idle health check ran meanwhile: all but the first are debug.
        down = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(down) >= 3 and sum(r.levelno == logging.DEBUG for r in down) == len(down) - 1
        tier._client.ping = lambda: True  # Redis is back
        tier.breaker.open_until = 0.0
        assert tier.check() is True
        assert any(r.levelno == logging.INFO and "reachable again" in r.getMessage() for r in caplog.records)
    store.close()
