"""MemoryPlanner: the prefill ladder on synthetic budgets, what reuse and the batch change, probing."""

from __future__ import annotations

import pytest

from kvboost_hf.planner import ModelShape
from kvboost_hf.planner.memory import MIB, MemoryPlanner
from tests.conftest import make_tiny

SHAPE = ModelShape(num_layers=18, num_kv_heads=1, head_dim=256, hidden_size=640, intermediate_size=2048,
                   vocab_size=262_144, num_attention_heads=4, dtype_bytes=4, sliding_window=512, sliding_layers=15)


def planner(free_mb: float, **kw) -> MemoryPlanner:
    return MemoryPlanner(SHAPE, int(free_mb * MIB), margin=0.0, **kw)


def test_roomy_budget_prefills_in_one_forward():
    plan = planner(4096).plan(4096, 64)
    assert plan.fits and plan.prefill_chunk_size is None and plan.generate_kwargs == {}


def test_tight_budget_picks_the_largest_chunk_that_fits():
    roomy = planner(10_000)
    larger = roomy.peak_bytes(4096, 64, prefill_chunk_size=2048)
    chunked = roomy.peak_bytes(4096, 64, prefill_chunk_size=1024)
    budget_mb = (chunked + (larger - chunked) // 2) / MIB  # 1024 fits, 2048 does not
    plan = planner(budget_mb).plan(4096, 64)
    assert plan.fits and plan.prefill_chunk_size == 1024 and plan.generate_kwargs == {"prefill_chunk_size": 1024}
    assert plan.predicted_peak_bytes == chunked <= plan.free_bytes


def test_nothing_fits_suggests_a_size_that_does():
    budget = planner(10_000).peak_bytes(1200, 100, prefill_chunk_size=128)  # room for exactly 100 new tokens
    tight = MemoryPlanner(SHAPE, budget, margin=0.0)
    plan = tight.plan(1200, 4000)
    assert not plan.fits and plan.suggested_max_tokens == 100
    payload = plan.error_payload()
    assert payload["prompt_tokens"] == 1200 and payload["predicted_peak_mb"] > payload["free_mb"] == round(budget / MIB, 1)
    assert tight.plan(1200, plan.suggested_max_tokens).fits
    assert not tight.plan(1200, plan.suggested_max_tokens + 1).fits
    too_long = tight.plan(8192, 16)
    assert not too_long.fits and too_long.suggested_max_tokens == 0  # the prompt alone does not fit
    kept = tight.truncated_prompt(8192, 16)
    assert 0 < kept < 8192 and tight.plan(kept, 16).fits and not tight.plan(kept + 1, 16).fits


def test_reuse_lowers_the_forward_not_the_kv_and_the_batch_adds_up():
    p = planner(10_000)
    cold, warm = p.peak_bytes(2048, 32), p.peak_bytes(2048, 32, reused_tokens=1900)
    assert warm < cold
    assert cold - warm == p.forward_bytes(2048, 2048) - p.forward_bytes(148, 2048)
    assert p.peak_bytes(2048, 32, batch_kv_bytes=5 * MIB) == cold + 5 * MIB
    edge = planner(cold / MIB)
    assert edge.plan(2048, 32).fits and not edge.plan(2048, 32, batch_kv_bytes=cold).fits


def test_sliding_layers_cap_only_without_reuse():
    assert planner(100, sliding_capped=True).kv_bytes(4096) < planner(100).kv_bytes(4096)
    assert planner(100, sliding_capped=True).kv_bytes(256) == planner(100).kv_bytes(256)


def test_plans_are_pure():
    p = planner(90)
    assert p.plan(3000, 16) == p.plan(3000, 16)
    assert (p.free_bytes, p.margin) == (90 * MIB, 0.0)


def test_probe_on_a_model_and_bad_inputs():
    model = make_tiny("llama")
    probed = MemoryPlanner.for_model(model, memory_limit=1 << 40)
    assert probed.free_bytes > 0 and probed.shape.weight_bytes_exact == sum(p.numel() * 4 for p in model.parameters())
    assert 0 < probed.decode_step_s < 10
    assert probed.plan(100, 10).fits
    with pytest.raises(ValueError, match="prompt_tokens"):
        probed.plan(0, 10)
    with pytest.raises(ValueError, match="free_bytes"):
        MemoryPlanner(SHAPE, 0)
    with pytest.raises(ValueError, match="margin"):
        MemoryPlanner(SHAPE, MIB, margin=1.5)


def test_quantized_rungs_come_only_after_every_lossless_one_and_only_when_allowed():
    lossless = planner(10_000)
    leanest_exact = lossless.peak_bytes(16_384, 64, prefill_chunk_size=128)
    int8 = lossless.peak_bytes(16_384, 64, prefill_chunk_size=128, kv_bits=8)
    int4 = lossless.peak_bytes(16_384, 64, prefill_chunk_size=128, kv_bits=4)
    assert int4 < int8 < leanest_exact  # at long contexts quantized K/V is the bigger saving
    budget_mb = (int8 + (leanest_exact - int8) // 2) / MIB  # int8 fits, no exact rung does
    assert not planner(budget_mb).plan(16_384, 64).fits  # default: never lossy
    plan = planner(budget_mb, kv_bits_options=(4, 8)).plan(16_384, 64)
    assert plan.fits and plan.kv_bits == 8 and plan.predicted_peak_bytes <= budget_mb * MIB  # 8 before 4
    assert plan.generate_kwargs == {"kv_bits": 8, "prefill_chunk_size": plan.prefill_chunk_size}
    assert plan.error_payload()["kv_bits"] == 8
    rungs = planner(1, kv_bits_options=(8, 4)).rungs()
    first_lossy = next(i for i, (_, bits) in enumerate(rungs) if bits is not None)
    assert all(bits is None for _, bits in rungs[:first_lossy]) and len(rungs) == 3 * len(rungs[:first_lossy])
    roomy = planner(10_000, kv_bits_options=(8, 4)).plan(16_384, 64)
    assert roomy.kv_bits is None  # lossy only when nothing exact fits


def test_a_quantized_rung_gets_no_credit_for_reuse():
    p = planner(10_000)
    assert p.peak_bytes(4096, 32, reused_tokens=4000, kv_bits=4) == p.peak_bytes(4096, 32, kv_bits=4)
    assert p.peak_bytes(4096, 32, reused_tokens=4000) < p.peak_bytes(4096, 32)


def test_int4_needs_less_than_int8_and_suggestions_consider_quantized_rungs():
    p = planner(10_000)
    budget = p.peak_bytes(16_384, 0, prefill_chunk_size=128, kv_bits=4)  # only int4 holds the prompt
    exact_only = MemoryPlanner(SHAPE, budget, margin=0.0)
    with_int4 = MemoryPlanner(SHAPE, budget, margin=0.0, kv_bits_options=(4,))
    assert exact_only.suggested_max_tokens(16_384) == 0 and with_int4.suggested_max_tokens(16_384) == 0
    assert exact_only.truncated_prompt(16_384, 0) < with_int4.truncated_prompt(16_384, 0) == 16_384


def test_kv_bits_options_are_checked():
    with pytest.raises(ValueError, match="kv_bits_options"):
        planner(100, kv_bits_options=(2,))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_kv_estimate_covers_a_buffered_caches_spare_room(family):
    """Cache layers keep up to SPARE_TOKENS of room to append in place: the estimate counts it."""
    from kvboost_hf.cache import BufferedCache
    from kvboost_hf.planner import kv_bytes_per_sequence
    from tests.conftest import random_ids

    model = make_tiny(family, seed=1)
    cache = BufferedCache(config=model.config)
    prompt, new = 40, 30
    model.generate(random_ids(prompt, 3), max_new_tokens=new, do_sample=False, past_key_values=cache)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.buffer.keys, layer.buffer.values))
    shape = ModelShape.from_config(model.config, dtype="float32")
    assert held > kv_bytes_per_sequence(shape, prompt + new)  # the tokens alone: what the estimate was
    assert held <= MemoryPlanner(shape, 10 * MIB, margin=0.0, sliding_capped=True).kv_bytes(prompt + new)
