"""Helpers of the fused-decoder and fused-layer tests: tiny AWQ models on the kvboost kernels, their logits over a
prefill, a chunk and steps, and the same run with the fused path and with transformers' modules."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvboost_hf.kernels.decoder import fuse_decoder, unfuse_decoder
from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
from tests.streaming.conftest import load_awq

LAYER_OPS = ("kvboost::layer_output", "kvboost::layer_step")  # a layer calls one of them once


def awq_model(family, tiny_awq, tiny_mistral_awq, dtype=torch.bfloat16):
    path = tiny_mistral_awq if family == "mistral" else tiny_awq[family][1]
    return load_awq(path, residency_mode="full_resident", kernel="kvboost", dtype=dtype)


def layer_op_calls(fn):
    """``(fn(), how many times the fused layer op ran)``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, sum(1 for event in prof.events() if event.name in LAYER_OPS)


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of a prefill, a 9-row chunk and three one-row steps over ``ids`` (5 forwards)."""
    cache, out, start = DynamicCache(config=model.config), [], 0
    for end in (ids.shape[1] - 12, ids.shape[1] - 3, ids.shape[1] - 2, ids.shape[1] - 1, ids.shape[1]):
        kwargs = {} if mask is None else {"attention_mask": mask[:, :end]}
        out.append(model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True, **kwargs).logits)
        start = end
    return torch.cat(out, dim=1)


def prefill_then_steps(model, ids: torch.Tensor, prefill: int, cache_class=DynamicCache) -> torch.Tensor:
    """The logits of a ``prefill``-token forward on a new cache, then of one forward per token to the end of ``ids``."""
    cache = cache_class(config=model.config)
    out = [model(input_ids=ids[:, :prefill], past_key_values=cache).logits]
    for t in range(prefill, ids.shape[1]):
        out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits)
    return torch.cat(out, dim=1)


def assert_fused_equals_unfused(model, run, layers: int, forwards: int) -> None:
    assert fuse_layers(model) == layers
    fused, calls = layer_op_calls(run)
    assert calls == layers * forwards  # the fused path really ran, every layer, every forward
    assert unfuse_layers(model) == layers
    plain, calls = layer_op_calls(run)
    assert calls == 0
    fuse_layers(model)
    assert torch.equal(fused, plain)


def fused_and_plain(model, run, fast_loops) -> tuple:
    """``run()`` with the decoder fused, then with transformers' forward; and how many forwards took the loop."""
    fast_loops["n"] = 0
    with torch.no_grad():
        fused = run()
        taken = fast_loops["n"]
        assert unfuse_decoder(model) == 1
        try:
            plain = run()
        finally:
            fuse_decoder(model)
    return fused, plain, taken
