"""Batch scheduler: a row waiting for its own tenant's prefill in flight would hold back every row queued behind
it (first come, first served), so bob's TTFT would tell him alice queued a request sharing her prompt's prefix.
A row waits only while nothing of another scope is queued (found by review; failed before the fix)."""
from __future__ import annotations

import asyncio

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse
from kvboost_hf.batching import BatchLimits
from kvboost_hf.server.engine.generation import SamplingParams
from kvboost_hf.server.routes.tenancy import SHARED_SALT
from kvboost_hf.server.scheduling.batch import BatchingQueue
from kvboost_hf.server.scheduling.rows import RowRequest, RowsRequest
from kvboost_hf.server.scheduling.workers import Job
from kvboost_hf.store.scope import CacheScope
from tests.conftest import make_tiny, make_tiny_tokenizer, random_ids


def test_bobs_row_never_waits_for_alices_prefill():
    model = make_tiny("llama", seed=4)
    store = ChunkStore(max_bytes=10**8, chunk_size=16)
    enable_chunk_reuse(model, store)
    loop = asyncio.new_event_loop()
    try:
        queue = BatchingQueue(model, make_tiny_tokenizer(), store, [], BatchLimits(8, 16), max_queue=8)

        def job(prompt, owner):
            params = SamplingParams(max_tokens=2, temperature=0,
                                    cache_scope=CacheScope(owner=owner, shared_salt=SHARED_SALT, epoch=0))
            j = Job(lambda j: None, loop=loop)
            j.request = RowsRequest([RowRequest(prompt, params)], lambda replies: replies)
            return j

        secret = random_ids(96, 3)[0].tolist()
        queue.submit(job(secret, "alice"))
        queue._step()  # alice's prompt starts prefilling (16 tokens a step)
        queue.submit(job(secret + [5, 6], "alice"))  # alice's next request shares her prefix: it waits
        queue.submit(job(random_ids(8, 4)[0].tolist(), "bob"))  # bob's unrelated request, the batch has room
        queue._step()
        owners = [row.seq.scope.owner for row in queue._rows]
        assert "bob" in owners, f"bob not admitted while alice's row waits on alice's prefill: running {owners}"
    finally:
        disable_chunk_reuse(model)
        loop.close()
