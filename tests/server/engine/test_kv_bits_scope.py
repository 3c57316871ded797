"""A request the memory plan put on quantized K/V (kv_bits) keeps its CacheScope: the draft model's own prefill
reuse reads and feeds the tenant's chains only (before the fix it used the unscoped chains every tenant shares)."""

from __future__ import annotations

import pytest

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.server.engine.generation import SamplingParams, generate_reply
from kvboost_hf.server.routes.tenancy import SHARED_SALT
from kvboost_hf.speculative.extension import set_default_draft
from kvboost_hf.store.scope import CacheScope
from tests.conftest import make_tiny, make_tiny_tokenizer, random_ids


@pytest.fixture
def serve():
    """``serve(owner)``: what Service.generate does for a tenant's request whose plan fell back to kv_bits=8,
    on a model with a default draft model; returns the request's draft_reused_tokens."""
    model, draft = make_tiny("llama", seed=4), make_tiny("llama", seed=1)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(model, store)
    set_default_draft(model, draft)
    tokenizer, prompt = make_tiny_tokenizer(), random_ids(40, 9)[0].tolist()

    def run(owner: str) -> int:
        params = SamplingParams(max_tokens=4, temperature=0, cache_scope=CacheScope(owner=owner, shared_salt=SHARED_SALT))
        generate_reply(model, tokenizer, prompt, params, [], store=store, generate_kwargs={"kv_bits": 8})
        return last_request_stats(model).speculation.draft_reused_tokens

    run.store = store
    yield run
    set_default_draft(model, None)
    disable_chunk_reuse(model)
    disable_chunk_reuse(draft)


def test_the_drafts_entries_are_charged_to_the_tenant(serve):
    serve("alice")
    owners = {e.owner for e in serve.store.entries()}
    assert serve.store.entries(), "the draft stored alice's prompt"
    assert owners == {"alice"}, f"alice's prompt stored charged to {owners} (not alice: unpurgeable, unquota'd)"


def test_another_tenants_draft_never_reuses_them(serve):
    assert serve("alice") == 0
    assert serve("bob") == 0, "bob's draft prefill loaded K/V of alice's prompt (timing leak)"
    assert serve("alice") > 0  # alice's own second request does
