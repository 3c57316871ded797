"""The memory planner in the server: 413 before any forward, --auto-truncate, calibration on stats and metrics."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from kvboost_hf import KIVICache
from kvboost_hf.planner import ModelShape
from kvboost_hf.planner.memory import MemoryPlanner
from kvboost_hf.server.scheduling.admission import MemoryAdmission
from tests.conftest import make_tiny
from tests.server.conftest import MODEL_NAME, cycle_words, serve, tiny_tokenizer


@pytest.fixture(scope="module")
def planned_server():
    with serve(make_tiny("llama", seed=8), tiny_tokenizer()) as running:
        yield running


def tight(server, free_bytes: int | None = None, auto_truncate: bool = False) -> MemoryAdmission:
    """Plan against ``free_bytes`` (default: twice what a 30-token request needs) instead of this machine's memory."""
    shape = ModelShape.from_config(server.model.config, dtype="float32")
    if free_bytes is None:
        free_bytes = 2 * MemoryPlanner(shape, 2**30, margin=0.0).peak_bytes(31, 8)
    admission = MemoryAdmission(MemoryPlanner(shape, free_bytes, margin=0.0), auto_truncate)
    server.app.state.service.admission = admission
    return admission


def forwards(model):
    count = [0]
    handle = model.register_forward_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    return count, handle


def test_a_request_that_cannot_fit_is_refused_before_any_forward(planned_server):
    admission = tight(planned_server)
    count, handle = forwards(planned_server.model)
    try:
        response = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": cycle_words(400), "max_tokens": 8, "temperature": 0})
        streamed = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": cycle_words(400), "max_tokens": 8, "stream": True})
    finally:
        handle.remove()
    assert response.status_code == 413 and streamed.status_code == 413 and count[0] == 0
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["prompt_tokens"] == 400
    assert error["predicted_peak_mb"] > error["free_mb"] == round(admission.planner.free_bytes / 2**20, 1)
    assert error["suggested_max_tokens"] == admission.planner.suggested_max_tokens(400, limit=8)
    assert admission.refused == 2
    ok = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json={
        "model": MODEL_NAME, "prompt": cycle_words(20), "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200  # a small request still fits


def test_auto_truncate_equals_generating_from_the_truncated_prompt(planned_server):
    admission = tight(planned_server, auto_truncate=True)
    prompt = cycle_words(400, start=5)
    ids = planned_server.tokenizer(prompt)["input_ids"]
    keep = admission.planner.truncated_prompt(len(ids), 6)
    assert 0 < keep < len(ids)
    response = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200 and response.headers["X-Kvboost-Truncated-From"] == str(len(ids))
    body = response.json()
    assert body["usage"]["prompt_tokens"] == keep
    with torch.no_grad():
        ref = planned_server.model.generate(torch.tensor([ids[:keep]]), max_new_tokens=6, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)
    assert body["choices"][0]["text"] == planned_server.tokenizer.decode(ref[0, keep:], skip_special_tokens=True)
    assert admission.truncated == 1


def test_calibration_on_stats_and_metrics(planned_server):
    tight(planned_server, free_bytes=2**34)
    for n in (30, 200):
        httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": cycle_words(n), "max_tokens": 4, "temperature": 0})
    memory = httpx.get(f"{planned_server.base_url}/v1/stats").json()["memory"]
    assert memory["requests"] == 2 and memory["residual_median"] is not None and memory["cohorts"]
    metrics = httpx.get(f"{planned_server.base_url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("kvboost_memory_")]
    assert "kvboost_memory_free_bytes 1.7179869184e+10" in lines and any("refused_total" in x for x in lines), lines


def test_kv_bits_fallback_serves_what_no_exact_rung_fits_and_says_so(planned_server):
    # The tiny model's K/V is too small to matter: plan as if it had 64 layers, so quantized K/V is the saving.
    shape = replace(ModelShape.from_config(planned_server.model.config, dtype="float32"), num_layers=64)
    probe = MemoryPlanner(shape, 2**34, margin=0.0)
    exact, lossy = (probe.peak_bytes(400, 6, prefill_chunk_size=128, kv_bits=b) for b in (None, 8))
    assert lossy < exact
    budget = (lossy + exact) // 2
    request = {"model": MODEL_NAME, "prompt": cycle_words(400, start=7), "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}
    planned_server.app.state.service.admission = MemoryAdmission(MemoryPlanner(shape, budget, margin=0.0))
    refused = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json=request)
    assert refused.status_code == 413 and refused.json()["error"]["kv_bits"] is None

    admission = MemoryAdmission(MemoryPlanner(shape, budget, margin=0.0, kv_bits_options=(8, 4)))
    planned_server.app.state.service.admission = admission
    store_size = len(planned_server.store)
    response = httpx.post(f"{planned_server.base_url}/v1/completions", timeout=30, json=request)
    assert response.status_code == 200 and response.headers["X-Kvboost-KV-Bits"] == "8"
    assert len(planned_server.store) == store_size  # approximate K/V are not stored
    ids = planned_server.tokenizer(request["prompt"])["input_ids"]
    plan = admission.planner.plan(len(ids), 6)
    with torch.no_grad():
        ref = planned_server.model.generate(
            torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
            past_key_values=KIVICache(planned_server.model.config, bits=8),
            **({} if plan.prefill_chunk_size is None else {"prefill_chunk_size": plan.prefill_chunk_size}))
    text = planned_server.tokenizer.decode(ref[0, len(ids):], skip_special_tokens=True)
    assert response.json()["choices"][0]["text"] == text


def test_several_candidates_are_planned_together(planned_server):
    """``n`` generations hold ``n`` K/V: a request that fits once can be refused three times over."""
    prompt, new = list(range(5, 25)), 400
    shape = ModelShape.from_config(planned_server.model.config, dtype="float32")
    roomy = MemoryPlanner(shape, 2**34, margin=0.0)
    kv = roomy.kv_bytes(len(prompt) + new, None)
    free = roomy.plan(len(prompt), new).predicted_peak_bytes + kv * 3 // 2
    admission = tight(planned_server, free_bytes=free)
    assert admission.planner.plan(len(prompt), new).fits
    assert not admission.planner.plan(len(prompt), new, batch_kv_bytes=2 * kv).fits
    url = f"{planned_server.base_url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": new, "temperature": 0}
    assert httpx.post(url, timeout=120, json=body).status_code == 200
    for extra in ({"n": 3, "temperature": 1.0, "seed": 1}, {"best_of": 3}):
        refused = httpx.post(url, timeout=30, json={**body, **extra})
        assert refused.status_code == 413, extra
        assert refused.json()["error"]["code"] == "request_too_large"
    two_prompts = httpx.post(url, timeout=30, json={**body, "prompt": [prompt, prompt[::-1], prompt[1:]]})
    assert two_prompts.status_code == 413  # three prompts of one request hold three K/V too
