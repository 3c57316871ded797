"""cache_salt: requests under different salts (or none) never share stored K/V; the same salt shares."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats, warm
from kvboost_hf.generation import reusable_tokens
from tests.conftest import make_tiny, random_ids

CHUNK = 8


@pytest.fixture
def model():
    m = make_tiny("llama")
    yield m
    disable_chunk_reuse(m)


def run(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=4, do_sample=False, **kw)
    return out, last_request_stats(model)


@pytest.mark.parametrize("first, second, shared", [
    ("alice", "alice", True),
    ("alice", "bob", False),
    (None, "alice", False),
    ("alice", None, False),
    (None, None, True),
])
def test_only_the_same_salt_reuses(model, first, second, shared, tmp_path):
    prompt = random_ids(40, 11)
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    # a disk tier too: a salted entry must be unreachable from another salt there as well
    store = ChunkStore(max_bytes=10**8, chunk_size=CHUNK, disk_path=tmp_path)
    enable_chunk_reuse(model, store)
    out, _ = run(model, prompt, cache_salt=first)
    assert torch.equal(out, expected)
    store.clear()  # RAM emptied: what the second request finds comes from disk
    assert (reusable_tokens(model, prompt[0].tolist(), cache_salt=second) > 0) == shared
    out, stats = run(model, prompt, cache_salt=second)
    assert torch.equal(out, expected)
    assert (stats.reused_tokens > 0) == shared


def test_warm_under_a_salt_serves_only_that_salt(model):
    system = random_ids(24, 5)
    prompt = torch.cat([system, random_ids(9, 6)], dim=1)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=CHUNK))
    warm(model, system, cache_salt="team-a")
    assert run(model, prompt)[1].reused_tokens == 0
    assert run(model, prompt, cache_salt="team-b")[1].reused_tokens == 0
    assert run(model, prompt, cache_salt="team-a")[1].reused_tokens == 24


def test_store_wide_drafts_read_only_their_salt(model):
    """A store draft proposes continuations of stored text: another salt's text must never be proposed."""
    text = random_ids(64, 21)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=CHUNK))
    model.generate(text, max_new_tokens=1, do_sample=False, cache_salt="owner")
    probe = text[:, :20]  # the stored text's opening, no repeats inside the probe itself
    always = {"adaptive": False, "max_tokens": 8}
    _, other = run(model, probe, cache_salt="prober", draft="store", speculation=always)
    _, owner = run(model, probe, cache_salt="owner", draft="store", speculation=always)
    assert other.speculation.drafted_tokens == 0
    assert owner.speculation.drafted_tokens > 0


@pytest.mark.parametrize("salt, error", [(3, TypeError), (b"x", TypeError), ("", ValueError)])
def test_a_bad_salt_is_refused(model, salt, error):
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=CHUNK))
    with pytest.raises(error, match="cache_salt"):
        model.generate(random_ids(8, 1), max_new_tokens=1, cache_salt=salt)
    with pytest.raises(error, match="cache_salt"):
        warm(model, random_ids(8, 1), cache_salt=salt)


def test_a_model_drafts_prefill_reuse_is_salted_too(model):
    """The draft model's own prompt K/V go in the store too: under the request's salt, never another's."""
    store = ChunkStore(max_bytes=10**8, chunk_size=CHUNK)
    enable_chunk_reuse(model, store)
    draft = make_tiny("llama", seed=1)
    prompt = random_ids(40, 9)
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    # Draft every round: whether the adaptive controller drafts (and so prefills the draft) depends on measured times.
    always = {"adaptive": False, "max_tokens": 4}
    out, stats = run(model, prompt, draft=draft, cache_salt="a", speculation=always)
    assert torch.equal(out, expected)
    _, other = run(model, prompt, draft=draft, cache_salt="b", speculation=always)
    assert other.reused_tokens == 0 and other.speculation.draft_reused_tokens == 0
    _, same = run(model, prompt, draft=draft, cache_salt="a", speculation=always)
    assert same.reused_tokens > 0 and same.speculation.draft_reused_tokens > 0
