"""Greedy decoding with every draft kind is token-identical to plain generate, with chunk reuse on."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import ControllerSettings, disable_chunk_reuse, last_request_stats, make_draft, make_head_draft
from tests.conftest import FAMILIES, make_tiny, make_tiny_tokenizer, random_ids, words

pytestmark = pytest.mark.usefixtures("one_thread")
# Always draft max_tokens after the prefill round: exactness is tested on rounds that speculate.
ALWAYS = ControllerSettings(adaptive=False, max_tokens=5, start_tokens=1, probe_tokens=1)


def _prompts(seed: int) -> list[torch.Tensor]:
    """A prompt that repeats itself (lookup drafts find matches), and one sharing its first 20 tokens."""
    base = random_ids(24, seed)
    first = torch.cat([base, base[:, 4:16], base[:, :6]], dim=1)
    second = torch.cat([first[:, :20], random_ids(9, seed + 1), base[:, 2:12]], dim=1)
    return [first, second, first]


def _drafts(family: str, model) -> dict:
    tokenizer = make_tiny_tokenizer()
    texts = [words(random_ids(60, 900 + k)) for k in range(4)]
    return {
        "prompt-lookup": "prompt-lookup",
        "store": "store",
        "assistant": make_tiny(family, seed=5, num_layers=1),
        "int4": make_draft(model, bits=4, activations=torch.float32),
        "int4-bf16": make_draft(model, bits=4, activations=torch.bfloat16),
        "int8-layers1": make_draft(model, bits=8, layers=1),  # activations="auto": depends on the CPU
        "int4-vocab48": make_draft(model, bits=4, vocab=48, tokenizer=tokenizer, texts=texts),
        "head": make_head_draft(model),
        "head-int4-vocab48": make_head_draft(model, 48, tokenizer=tokenizer, texts=texts, head_bits=4),
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_draft_kind_is_token_identical(family, tiny_models, reuse):
    model = tiny_models[family]
    prompts = _prompts(11)
    kw = dict(max_new_tokens=14, do_sample=False)
    refs = [model.generate(ids, **kw) for ids in prompts]
    for name, draft in _drafts(family, model).items():
        reuse(model)  # a fresh store per draft kind
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            out = model.generate(ids, draft=draft, speculation=ALWAYS, **kw)
            assert torch.equal(out, ref), (family, name, i)
            stats = last_request_stats(model)
            assert stats.speculation is not None and stats.speculation.draft
            if i == 2:  # the same prompt again: served from the store
                assert stats.reused_tokens > 0, (family, name)
        assert stats.speculation.drafted_tokens > 0, (family, name)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("max_tokens", [1, 3, 8])
def test_chunk_boundaries_and_lengths(family, tiny_models, max_tokens, reuse):
    """Draft lengths crossing chunk boundaries, EOS in the drafts, max_length cut mid-draft."""
    model = tiny_models[family]
    settings = ControllerSettings(adaptive=False, max_tokens=max_tokens, start_tokens=1, probe_tokens=1)
    ids = torch.cat([random_ids(13, 3), torch.tensor([[2]]), random_ids(13, 3)], dim=1)  # holds an EOS id
    draft = make_draft(model, bits=8)
    refs = {new: model.generate(ids, max_new_tokens=new, do_sample=False) for new in (1, 2, 7, 13)}
    reuse(model, chunk_size=4)
    for new, ref in refs.items():
        for kind in ("store", draft, make_head_draft(model)):
            out = model.generate(ids, max_new_tokens=new, do_sample=False, draft=kind, speculation=settings)
            assert torch.equal(out, ref), (new, kind)


def test_adaptive_default_is_identical_and_hf_kwargs_still_work(tiny_models, reuse):
    model = tiny_models["qwen2"]
    ids = _prompts(5)[0]
    kw = dict(max_new_tokens=12, do_sample=False)
    ref = model.generate(ids, **kw)
    reuse(model)
    assert torch.equal(model.generate(ids, draft="store", **kw), ref)
    # HF's own prompt lookup keeps HF's generator and gains telemetry
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), ref)
    spec = last_request_stats(model).speculation
    assert spec.draft == "hf-prompt-lookup" and spec.rounds >= 1
    # assistant_model= is a model draft
    draft = make_draft(model, bits=8)
    assert torch.equal(model.generate(ids, assistant_model=draft, **kw), ref)
    assert last_request_stats(model).speculation.draft == draft.draft_name and draft.draft_name.startswith("int8")


def test_without_reuse_draft_is_not_accepted(tiny_models):
    model = tiny_models["llama"]
    disable_chunk_reuse(model)
    with pytest.raises(ValueError, match="draft"):
        model.generate(random_ids(8, 1), max_new_tokens=2, draft="store")
