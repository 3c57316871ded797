"""A model whose RoPE recomputes its frequencies from the longest position a forward sees (transformers' "dynamic"
and "longrope") decodes without drafts and without reuse: a verification forwards positions plain decoding does not
reach together, and stored K/V come from forwards of other lengths; either would change the reply."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvboost_hf import ControllerSettings, last_request_stats, make_head_draft
from kvboost_hf.models.rope import length_dependent_rope
from tests.conftest import _COMMON, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")
ALWAYS = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def _llama(rope: dict, seed: int = 1, positions: int = 16) -> torch.nn.Module:
    """A tiny bf16 Llama of ``positions`` original positions (past 16, the prompts below run past them, where dynamic
    RoPE rescales)."""
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, rope_parameters=rope, **dict(_COMMON, max_position_embeddings=positions))
    return LlamaForCausalLM(config).eval().to(torch.bfloat16)


@pytest.mark.parametrize("rope,expected", [
    ({"rope_type": "default", "rope_theta": 10000.0}, None),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, None),
    (DYNAMIC, "dynamic"),
    ({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ({"type": "longrope"}, "longrope"),
    ({"sliding_attention": {"rope_type": "dynamic", "factor": 2.0}, "full_attention": None}, "dynamic"),
])
def test_the_rope_types_that_depend_on_the_longest_position(rope, expected):
    class Config:
        rope_parameters = rope
        max_position_embeddings = 32

    assert length_dependent_rope(Config()) == expected
    assert length_dependent_rope(Config(), 31) is None  # every forward shorter than the original length
    assert length_dependent_rope(Config(), 32) == expected
    Config.rope_parameters = {**rope, "original_max_position_embeddings": 8} if expected and "type" in rope else rope
    if "type" in rope:  # the smaller of the two lengths bounds it
        assert length_dependent_rope(Config(), 8) == expected and length_dependent_rope(Config(), 7) is None


@pytest.mark.parametrize("draft", ["prompt-lookup", "head"])
def test_a_dynamic_rope_model_replies_as_plain_generate_without_drafts_or_reuse(reuse, draft, caplog):
    # 28 tokens, past the 16 original positions. With drafts (the check answering None) both drafts' replies to this
    # prompt differ from plain generate's within 60 tokens.
    ids = torch.cat([random_ids(14, 3), random_ids(14, 3)], dim=1)
    baseline = _llama(DYNAMIC)  # plain generate, whose rotary module keeps the longest position of its calls
    model = _llama(DYNAMIC)
    reuse(model)
    chosen = make_head_draft(model) if draft == "head" else draft
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.speculative.request"):
        for _ in range(2):  # the second call reads nothing the first stored (its K/V came from another scale)
            plain = baseline.generate(ids, max_new_tokens=60, do_sample=False)
            out = model.generate(ids, max_new_tokens=60, do_sample=False, draft=chosen, speculation=ALWAYS)
            assert torch.equal(out, plain)
            stats = last_request_stats(model)
            assert stats.speculation is None and stats.reused_tokens == 0 and "rope_type 'dynamic'" in stats.reason
    assert sum("without drafts" in r.getMessage() for r in caplog.records) == 1  # once a model
    with pytest.raises(ValueError, match="expected one of"):  # a wrong draft is still an error
        model.generate(ids, max_new_tokens=2, do_sample=False, draft="no-such-draft")


@pytest.mark.parametrize("draft", ["prompt-lookup", "head"])
def test_calls_that_stay_within_the_original_length_draft(reuse, draft):
    """Below the original length every forward resets a dynamic rotary module to its original frequencies: such a
    call drafts, with plain generate's reply, even after a call past it. Stored K/V are never used: a key depends on
    the forward that computed it (in a packed batch, on the other rows' positions too)."""
    ids = torch.cat([random_ids(14, 3), random_ids(14, 3)], dim=1)
    model = _llama(DYNAMIC, positions=96)
    reuse(model)
    chosen = make_head_draft(model) if draft == "head" else draft
    plain = _llama(DYNAMIC, positions=96).generate(ids, max_new_tokens=40, do_sample=False)
    model.generate(ids, max_new_tokens=80, do_sample=False)  # past 96: the module grows
    for _ in range(2):
        out = model.generate(ids, max_new_tokens=40, do_sample=False, draft=chosen, speculation=ALWAYS)
        assert torch.equal(out, plain)
        stats = last_request_stats(model)
        assert stats.speculation is not None and stats.speculation.drafted_tokens > 0
        assert stats.reused_tokens == 0 and "rope_type 'dynamic'" in stats.reason


def test_no_path_reads_or_writes_stored_kv_of_such_a_model(reuse):
    """warm, a caller's own ChunkReuseCache (the server's) and the server's prompt logprobs all step aside (found
    by an adversarial review: the first guard sat in generate's wrapper only)."""
    from kvboost_hf import ChunkReuseCache, warm
    from kvboost_hf.server.decoding.logprobs import prompt_logprobs

    ids = torch.cat([random_ids(14, 3), random_ids(14, 3)], dim=1)
    model = _llama(DYNAMIC)
    store = reuse(model)
    warm(model, ids)
    model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=ChunkReuseCache(model.config, store))
    assert last_request_stats(model).reused_tokens == 0
    prompt_logprobs(model, ids[0].tolist(), 0, store=store)
    assert len(store) == 0


@pytest.mark.parametrize("how", ["argument", "generation config"])
def test_transformers_own_prompt_lookup_is_turned_off_too(reuse, how, monkeypatch):
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    calls = []
    original = GenerationMixin._assisted_decoding
    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.cat([random_ids(14, 3), random_ids(14, 3)], dim=1)
    model = _llama(DYNAMIC)
    reuse(model)
    lookup = ({"prompt_lookup_num_tokens": 4} if how == "argument" else
              {"generation_config": GenerationConfig(prompt_lookup_num_tokens=4, max_new_tokens=40, do_sample=False)})
    out = model.generate(ids, max_new_tokens=40, do_sample=False, **lookup)
    assert calls == [] and torch.equal(out, _llama(DYNAMIC).generate(ids, max_new_tokens=40, do_sample=False))
