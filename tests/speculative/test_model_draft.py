"""ModelProposer: the controller owns the draft length; the draft's stored prompt is not charged as catch-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.models.namespace import namespace
from kvboost_hf.speculative.model_draft import ModelProposer
from tests.conftest import make_tiny, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def _inner(assistant) -> SimpleNamespace:
    return SimpleNamespace(generation_config=GenerationConfig(assistant_confidence_threshold=0.4),
                           assistant_generation_config=GenerationConfig(assistant_confidence_threshold=0.4),
                           assistant_model=assistant, assistant_kwargs={})


@pytest.mark.parametrize("owns", [True, False])
def test_confidence_stop_is_off_only_when_the_controller_owns_the_length(owns):
    inner = _inner(make_tiny("llama", seed=5, num_layers=1))
    ModelProposer(inner, owns_length=owns)
    expected = 0.0 if owns else 0.4
    assert inner.generation_config.assistant_confidence_threshold == expected
    assert inner.assistant_generation_config.assistant_confidence_threshold == expected


def test_adaptive_rounds_draft_what_the_controller_chose(reuse):
    """A random tiny assistant is rarely confident: with HF's confidence stop, rounds ended early."""
    target = make_tiny("llama", seed=2)
    reuse(target)
    assistant = make_tiny("llama", seed=5, num_layers=1)
    settings = ControllerSettings(min_gain=1e-6, start_tokens=4)  # keep speculating whatever it measures
    ids = random_ids(30, 6)
    target.generate(ids, max_new_tokens=24, do_sample=False, draft=assistant, speculation=settings)
    spec = last_request_stats(target).speculation
    chosen = sum(k * n for k, n in spec.choices)
    assert spec.speculative_rounds > 0 and spec.drafted_tokens == chosen


def test_a_stored_draft_prompt_is_not_catch_up(reuse):
    target = make_tiny("llama", seed=2)
    store = reuse(target, chunk_size=8)
    draft = make_draft(make_tiny("llama", seed=2), bits=8)  # a twin's: a self-draft takes its prompt from target
    ids = random_ids(43, 7)
    always = ControllerSettings(adaptive=False, max_tokens=3, start_tokens=1, probe_tokens=1)
    target.generate(ids, max_new_tokens=5, do_sample=False, draft=draft, speculation=always)
    stored = store.stored_prefix_length(namespace(draft), ids[0].tolist())
    assert stored == 43  # the prompt, followed in the store by the confirmed reply
    assert store.stored_prefix_length(namespace(draft), [1, 2, 3]) == 0
    assert store.stored_prefix_length(namespace(target), ids[0].tolist()) == 43  # the target's own namespace
    proposer = ModelProposer(_inner(draft))
    longer = torch.cat([ids, random_ids(50, 8)], dim=1)
    assert proposer.unseen(ids) == 0 and proposer.unseen(longer) == 50
    assert ModelProposer(_inner(draft)).unseen(random_ids(43, 99)) == 43
    target.generate(ids, max_new_tokens=5, do_sample=False, draft=draft, speculation=always)
    assert last_request_stats(target).speculation.draft_reused_tokens >= 40


def test_a_zero_minimum_is_not_passed_to_the_draft_generate():
    """generate would turn it into an inert min-length processor that scans the vocabulary per token."""
    inner = _inner(make_tiny("llama", seed=5, num_layers=1))
    inner._prepare_generation_args = lambda ids, low, high: {"input_ids": ids, "min_new_tokens": low,
                                                             "max_new_tokens": high}
    ModelProposer(inner)
    assert "min_new_tokens" not in inner._prepare_generation_args(None, 0, 4)
    assert inner._prepare_generation_args(None, 3, 4)["min_new_tokens"] == 3  # a real minimum stays


def test_a_draft_whose_own_config_sets_a_minimum_keeps_the_zero():
    """generate fills an unset minimum from the draft's own generation config: the zero overrides it."""
    assistant = make_tiny("llama", seed=5, num_layers=1)
    assistant.generation_config.min_new_tokens = 3
    inner = _inner(assistant)
    inner._prepare_generation_args = lambda ids, low, high: {"min_new_tokens": low, "max_new_tokens": high}
    ModelProposer(inner)
    assert inner._prepare_generation_args(None, 0, 4)["min_new_tokens"] == 0


def test_min_new_tokens_still_holds_with_a_draft(reuse):
    target = make_tiny("llama", seed=2)
    reuse(target)
    draft = make_draft(target, bits=8)
    ids = random_ids(20, 4)
    eos = int(target.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])  # the first greedy token ends it
    always = ControllerSettings(adaptive=False, max_tokens=3, start_tokens=1, probe_tokens=1)
    out = target.generate(ids, max_new_tokens=12, min_new_tokens=6, do_sample=False, eos_token_id=eos,
                          draft=draft, speculation=always)
    ref = target.generate(ids, max_new_tokens=12, min_new_tokens=6, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, ref) and out.shape[1] - ids.shape[1] >= 6
