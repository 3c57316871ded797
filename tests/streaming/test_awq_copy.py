"""Copies of AWQ models: a resident one deep-copies and pickles (its runtime's locks are made anew); a streamed one
refuses with an error that says what to do instead."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from kvboost_hf.streaming.loader import RUNTIME_ATTR
from tests.streaming.conftest import load_awq


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_resident_model_deep_copies_and_pickles_to_the_same_logits(tiny_awq):
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="auto", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(43))
    want = _logits(model, ids)
    twin = copy.deepcopy(model)
    assert torch.equal(_logits(twin, ids), want)
    runtime, twin_runtime = getattr(model, RUNTIME_ATTR), getattr(twin, RUNTIME_ATTR)
    assert twin_runtime is not runtime and twin_runtime.lock is not runtime.lock
    assert twin_runtime.stats._lock is not runtime.stats._lock
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(_logits(loaded, ids), want)
    next(p for p in twin.parameters() if p.is_floating_point()).data.mul_(2)  # the copy owns its tensors
    assert torch.equal(_logits(model, ids), want)


def test_a_streamed_model_refuses_to_be_copied_and_says_what_to_do(tiny_awq):
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_stream", n_staging_slots=2)
    with pytest.raises(TypeError, match="load the checkpoint again"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="full_resident"):
        torch.save(model, io.BytesIO())
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(47))
    assert _logits(model, ids).shape == (1, 12, model.config.vocab_size)  # the original still runs
