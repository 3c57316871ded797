"""Row-exact verification on an AWQ int4 target: k + 1 verified rows equal k + 1 decode steps, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.speculative import exact_rows
from kvboost_hf.speculative.exact_rows import needs_exact_rows, route_rows, verifying
from kvboost_hf.streaming import StreamingAWQConfig
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import SLIDING_WINDOW, make_tiny, random_ids

pytestmark = pytest.mark.usefixtures("one_thread")


def _int4_target(family: str, path, layers: int = 4):
    model = make_tiny(family, seed=3, num_layers=layers)
    pack_model(model, path, group_size=32)
    config = StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).eval()


def _decode_hidden(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """Last-layer hidden states of ``ids[prefix:]`` decoded one token at a time."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
    rows = [model.model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
            for t in range(prefix, ids.shape[1])]
    return torch.stack(rows)


def _verify_hidden(model, ids: torch.Tensor, prefix: int) -> torch.Tensor:
    """The same rows from one verification forward, attention routed per row."""
    cache = DynamicCache(config=model.config)
    with verifying(model):
        model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True)
        route_rows(ids.shape[1] - prefix)
        return model.model(input_ids=ids[:, prefix:], past_key_values=cache, use_cache=True).last_hidden_state[0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("prefix", [5, SLIDING_WINDOW + 3])  # inside and beyond the sliding window
def test_verified_rows_equal_decode_steps(family, prefix, tmp_path, monkeypatch):
    target = _int4_target(family, tmp_path / "ckpt")
    assert needs_exact_rows(target)
    ids = random_ids(prefix + 7, 4)
    calls = []
    real = exact_rows.sdpa_attention_forward
    monkeypatch.setattr(exact_rows, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    with torch.no_grad():
        decoded = _decode_hidden(target, ids, prefix)
        verified = _verify_hidden(target, ids, prefix)
    assert torch.equal(verified, decoded)
    assert calls and set(calls) == {1}  # one query row per SDPA call
    assert target.config._attn_implementation == "sdpa"  # restored after the request


def test_a_float_target_keeps_the_batched_call(tmp_path):
    assert not needs_exact_rows(make_tiny("llama"))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_adaptive_speculation_on_an_int4_target_is_token_identical(family, tmp_path, reuse):
    target = _int4_target(family, tmp_path / "ckpt", layers=5)
    draft = make_draft(target, bits=4)
    reuse(target)
    settings = ControllerSettings(min_gain=1e-6, start_tokens=3, max_tokens=6)  # speculate in every round it can
    verified = reused = 0
    common = random_ids(5, 99)  # later prompts reuse a partial chunk: the sliding layers load from the store
    for seed in (1, 2, 3):
        ids = torch.cat([common, random_ids(SLIDING_WINDOW + 4, seed)], dim=1)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False, draft=None)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, draft=draft, speculation=settings)
        assert torch.equal(out, ref)
        spec = last_request_stats(target).speculation
        assert spec.choices[0][0] == 0  # round 0, the prompt prefill, never carries drafts here
        verified += spec.drafted_tokens
        reused += last_request_stats(target).reused_tokens
    assert verified > 0 and reused > 0
