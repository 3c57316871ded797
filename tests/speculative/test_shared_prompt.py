"""A self-draft starts from its target's prompt K/V (shared_prompt.py): outputs unchanged, nothing prefilled."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.models.namespace import namespace
from kvboost_hf.speculative.shared_prompt import draft_source, prompt_donor
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")

ALWAYS = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)


def _draft_forwards(draft) -> list[int]:
    """Rows of each forward the draft runs (a hook), to see whether it prefilled the prompt."""
    rows: list[int] = []
    draft.register_forward_pre_hook(lambda _m, args, kwargs: rows.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return rows


@pytest.mark.parametrize("family, layers", [("llama", None), ("gemma3", None), ("gemma3", 2), ("mistral", 1)])
def test_a_self_draft_takes_the_prompt_from_its_target(family, layers, reuse):
    model = make_tiny(family, seed=3)
    store = reuse(model, chunk_size=4)
    draft = make_draft(model, bits=8, layers=layers)
    rows = _draft_forwards(draft)
    ids = random_ids(3 * SLIDING_WINDOW + 5, 11)  # longer than the sliding window: its history is given too
    plain = model.generate(ids, max_new_tokens=10, do_sample=False)
    spec_out = model.generate(ids, max_new_tokens=10, do_sample=False, draft=draft, speculation=ALWAYS)
    assert torch.equal(spec_out, plain)
    spec = last_request_stats(model).speculation
    assert spec.draft_given_tokens == ids.shape[1] - 1 and spec.speculative_rounds > 0
    assert max(rows) <= ALWAYS.max_tokens + 1, rows  # the draft never forwarded the prompt itself
    assert not store.token_chains(namespace(draft))  # K/V it did not compute are not stored as its own
    assert store.token_chains(namespace(model))


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_prompts_too_short_to_give_are_decoded_exactly(family, n, reuse):
    """A one-token prompt gives the draft nothing: its first crop is of an empty sliding layer."""
    model = make_tiny(family, seed=3)
    reuse(model, chunk_size=4)
    draft = make_draft(model, bits=8)
    ids = random_ids(n, 100 + n)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, draft=draft, speculation=ALWAYS), plain)
    assert last_request_stats(model).speculation.draft_given_tokens == n - 1


def test_a_seeded_sampled_reply_does_not_depend_on_where_the_draft_prompt_came_from(reuse):
    model = make_tiny("gemma3", seed=3)
    reuse(model, chunk_size=4)
    given, prefilled = make_draft(model, bits=4), make_draft(make_tiny("gemma3", seed=3), bits=4)
    ids = random_ids(40, 12)
    replies = []
    for draft in (given, prefilled, "prompt-lookup"):
        torch.manual_seed(5)
        out = model.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.3, top_k=20, draft=draft,
                             speculation=ALWAYS)
        replies.append(out[0].tolist())
        assert last_request_stats(model).speculation.draft_given_tokens == (39 if draft is given else 0)
    assert replies[0] == replies[1] == replies[2]


def test_a_draft_of_another_model_prefills_itself(reuse):
    model, twin = make_tiny("llama", seed=3), make_tiny("llama", seed=3)  # the same weights, not the same model
    store = reuse(model, chunk_size=4)
    draft = make_draft(twin, bits=8)
    assert draft_source(draft) is twin
    rows = _draft_forwards(draft)
    ids = random_ids(30, 13)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, draft=draft, speculation=ALWAYS), plain)
    assert last_request_stats(model).speculation.draft_given_tokens == 0
    assert max(rows) >= 29  # it prefilled the prompt
    assert store.token_chains(namespace(draft))  # and stored its own K/V


def test_no_donor_for_unlike_caches():
    model = make_tiny("gemma3", seed=3)
    draft = make_draft(model, bits=8)
    other = make_tiny("llama", seed=3)
    mine = ChunkReuseCache(draft.config)
    assert prompt_donor(model, draft, ChunkReuseCache(model.config), mine) is not None
    assert prompt_donor(model, draft, ChunkReuseCache(other.config), mine) is None  # full layers, not sliding
    assert prompt_donor(other, draft, ChunkReuseCache(model.config), mine) is None  # not its target
    assert prompt_donor(model, draft, None, mine) is None and prompt_donor(model, draft, ChunkReuseCache(model.config),
                                                                           None) is None


def test_a_cache_of_another_prompt_gives_nothing(reuse):
    model = make_tiny("llama", seed=3)
    reuse(model, chunk_size=4)
    draft = make_draft(model, bits=8)
    target_cache, draft_cache = ChunkReuseCache(model.config), ChunkReuseCache(draft.config)
    ids = random_ids(20, 14)
    with torch.no_grad():
        model(ids, past_key_values=target_cache, use_cache=True)
    donor = prompt_donor(model, draft, target_cache, draft_cache)
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 90 + 3
    assert donor.give(draft_cache, other) == 0 and draft_cache.get_seq_length() == 0
    assert donor.give(draft_cache, ids) == 18 and draft_cache.get_seq_length() == 18
    keys = draft_cache.layers[0].keys
    assert torch.equal(keys, target_cache.layers[0].keys[:, :, :18].to(keys.dtype))
    assert keys.data_ptr() != target_cache.layers[0].keys.data_ptr()  # a copy: the target's tensors stay its own
