"""One ``torch.ops.kvboost.decoder_step`` call a forward on in-place cache layers (``kernels.decoder``): the layers'
arguments as flat lists the plan keeps, the same ``layer_step`` calls in the same order, so the bits and the cache
state of one ``layer_step`` call a layer from Python."""

from __future__ import annotations

import copy

import pytest
import torch

from kvboost_hf.cache import buffer
from kvboost_hf.kernels import decoder as fused_decoder
from kvboost_hf.kernels.plan import checked_plan
from tests.streaming.fused_models import awq_model
from tests.streaming.test_awq_fused_layer_step import assert_same_cache, decode, new_cache

DECODER_OP = "kvboost::decoder_step"


def per_layer(monkeypatch) -> None:
    """Makes the fused decoder call ``layer_step`` once a layer from Python (as where a layer declines to reserve)."""
    monkeypatch.setattr(fused_decoder, "_reserved", lambda *args: None)


def op_counts(fn) -> tuple:
    """``(fn(), decoder_step calls, layer_step calls)``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    names = [event.name for event in prof.events()]
    return result, names.count(DECODER_OP), names.count("kvboost::layer_step")


@pytest.mark.parametrize("family", ["gemma3", "mistral"])  # two rotary kinds (sliding and full layers), and one
@pytest.mark.parametrize("kind", ["dynamic", "recording", "buffered", "reuse"])
@pytest.mark.parametrize("batch", [1, 2])
def test_one_call_a_forward_gives_the_bits_and_the_cache_of_one_call_a_layer(
        family, kind, batch, tiny_awq, tiny_mistral_awq, kernels_built, fast_loops, monkeypatch):
    """Past the sliding window (16 tokens) and through many refills of the buffers (2 spare tokens each)."""
    monkeypatch.setattr(buffer, "SPARE_TOKENS", 2)
    model = awq_model(family, tiny_awq, tiny_mistral_awq)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 96, (batch, 40), generator=torch.Generator().manual_seed(40 + batch))
    with torch.no_grad():
        one_cache = new_cache(kind, model.config)
        one, decoder_calls, layer_calls = op_counts(lambda: decode(model, one_cache, ids))
        with monkeypatch.context() as patch:
            per_layer(patch)
            each_cache = new_cache(kind, model.config)
            each, none, each_calls = op_counts(lambda: decode(model, each_cache, ids))
    assert fast_loops["n"] == 2 * 21 and none == 0
    # every step but the first after each refill (one in three with 2 spare tokens), never at the prefill; each call
    # runs every layer through layer_step, as the per-layer loop does
    assert 10 <= decoder_calls < 20 and layer_calls == layers * decoder_calls == each_calls
    assert torch.equal(one, each)
    assert_same_cache(one_cache, each_cache)


def test_the_arguments_are_made_once_per_plan(tiny_awq, kernels_built):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = new_cache("buffered", model.config)
        decode(model, cache, ids)
        plan = checked_plan(model.model, cache)
        fused = plan.fused
        assert fused is not None and len(fused[0]) == 7 * model.config.num_hidden_layers
        assert len(plan.rotary) == 2 and set(plan.rope) == {0, 1}  # Gemma 3: a rotary embedding per layer type
        decode(model, new_cache("buffered", model.config), ids)
        assert checked_plan(model.model, cache) is plan and plan.fused is fused
        model.model.layers[1].self_attn.scaling = 0.5  # read by the plan: a new plan, new lists at its first use
        decode(model, new_cache("buffered", model.config), ids)
        again = checked_plan(model.model, cache)
    assert again is not plan and again.fused is not None and again.fused is not fused


def test_a_tensor_swapped_after_a_call_is_read_as_it_is_now(tiny_awq, kernels_built, monkeypatch):
    """``torch.utils.swap_tensors`` (as ``Module.to`` does under ``set_swap_module_params_on_conversion``) needs
    tensors nothing else holds a reference to: the op holds none past its call, and the plan's tensor objects
    then carry the swapped data."""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 26), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        before, calls, _ = op_counts(lambda: decode(model, new_cache("buffered", model.config), ids))
        plan = checked_plan(model.model, new_cache("buffered", model.config))
        norm = plan.layers[1][0].norms[0]
        torch.utils.swap_tensors(norm, (norm * 2).clone())
        after = decode(model, new_cache("buffered", model.config), ids)
        with monkeypatch.context() as patch:
            per_layer(patch)
            expected = decode(model, new_cache("buffered", model.config), ids)
        monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
        model.to(torch.float32)
        converted, float_calls, _ = op_counts(lambda: decode(model, new_cache("buffered", model.config), ids))
        with monkeypatch.context() as patch:
            per_layer(patch)
            converted_expected = decode(model, new_cache("buffered", model.config), ids)
    assert calls > 0 and float_calls > 0
    assert not torch.equal(after, before) and torch.equal(after, expected)
    assert converted.dtype == torch.float32 and torch.equal(converted, converted_expected)


def test_a_weight_repointed_in_place_is_read_where_it_is_now(tiny_awq, kernels_built, monkeypatch):
    """``Tensor.set_`` keeps the tensor object (the plan still holds, as after ``back_with_huge_pages``): the held
    layers read its data where it is at each call, never the memory it left."""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 26), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = decode(model, new_cache("buffered", model.config), ids)
        plan = checked_plan(model.model, new_cache("buffered", model.config))
        weight = plan.layers[2][0].qweights[5]  # up_proj's codes
        moved = torch.flip(weight, dims=(1,)).contiguous()  # other codes: other outputs
        weight.set_(moved)
        after, decoder_calls, _ = op_counts(lambda: decode(model, new_cache("buffered", model.config), ids))
        assert checked_plan(model.model, new_cache("buffered", model.config)).fused is plan.fused
        with monkeypatch.context() as patch:
            per_layer(patch)
            expected = decode(model, new_cache("buffered", model.config), ids)
    assert decoder_calls > 0
    assert not torch.equal(after, before)
    assert torch.equal(after, expected)


def step_arguments(model, rows: int = 1, seed: int = 8) -> tuple:
    """``decoder_step``'s arguments for ``model``'s plan: random hidden states and rotary tables (two kinds), zeroed
    8-position buffers, live keys from 0, new rows at 3."""
    with torch.no_grad():
        decode(model, new_cache("buffered", model.config), torch.randint(3, 96, (1, 22)))
    plan = checked_plan(model.model, new_cache("buffered", model.config))
    count, head_dim = len(plan.layers), model.config.head_dim
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, rows, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    cos = [torch.randn(1, rows, head_dim, generator=gen).to(torch.bfloat16) for _ in range(4)]
    shape = (1, plan.layers[0][0].outs[1] // head_dim, 8, head_dim)
    keys = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(count)]
    values = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(count)]
    return plan, (hidden, *plan.fused, cos[:2], cos[2:], keys, values, [0] * count, [3] * count)


def test_the_one_call_op_refuses_lists_that_do_not_match_its_layers(tiny_awq, kernels_built):
    model = awq_model("gemma3", tiny_awq, None)
    plan, args = step_arguments(model)
    count, step = len(plan.layers), torch.ops.kvboost.decoder_step
    hidden, *lists, cos, sin, keys, values, firsts, ends = args
    with pytest.raises(RuntimeError, match="expected 7 projections"):
        step(hidden, lists[0][1:], *lists[1:], cos, sin, keys, values, firsts, ends)
    with pytest.raises(RuntimeError, match=f"expected {count} key buffers, value buffers"):
        step(hidden, *lists, cos, sin, keys, values[1:], firsts, ends)
    with pytest.raises(RuntimeError, match="takes cos/sin 1 of 1"):  # Gemma 3's layers take two kinds
        step(hidden, *lists, cos[:1], sin[:1], keys, values, firsts, ends)
    with pytest.raises(RuntimeError, match="as many cos as sin"):
        step(hidden, *lists, cos, sin[:1], keys, values, firsts, ends)
    norms = list(lists[5])
    norms[4] = None  # layer 1's input norm
    with pytest.raises(RuntimeError, match="layer 1 needs its input and feed-forward norms"):
        step(hidden, *lists[:5], norms, *lists[6:], cos, sin, keys, values, firsts, ends)
    assert not any(b.any() for b in keys + values)  # refused before any layer wrote
    out, new_keys, _ = step(*args)
    assert out.shape == hidden.shape and len(new_keys) == count and torch.equal(keys[-1][:, :, 3:4], new_keys[-1])


def test_the_one_call_op_writes_only_what_its_schema_marks(tiny_awq, kernels_built):
    """The buffers (marked (a!)/(b!)) and nothing else: its other inputs keep their values and version counters;
    ``torch.library.opcheck`` passes its schema, fake kernel and autograd registration tests."""
    model = awq_model("gemma3", tiny_awq, None)
    plan, args = step_arguments(model, rows=2, seed=9)
    hidden, *lists, cos, sin, keys, values, firsts, ends = args
    weights = [t for a, *_ in plan.layers for t in (*a.qweights, *a.sides, *a.norms) if t is not None]
    inputs = [hidden, *cos, *sin, *weights]
    copies, versions = [t.clone() for t in inputs], [t._version for t in inputs]
    key_versions = [k._version for k in keys]
    with torch.no_grad():
        out, new_keys, new_values = torch.ops.kvboost.decoder_step(*args)
    assert all(torch.equal(t, c) for t, c in zip(inputs, copies)) and [t._version for t in inputs] == versions
    for k, v, nk, nv, before in zip(keys, values, new_keys, new_values, key_versions):
        assert torch.equal(k[:, :, 3:5], nk) and torch.equal(v[:, :, 3:5], nv) and k._version > before
        assert not k[:, :, :3].any() and not k[:, :, 5:].any() and not v[:, :, 5:].any()
    # (not test_aot_dispatch_*: functionalization does not take mutable tensor lists; the loop that calls the op never
    # runs while compiling)
    result = torch.library.opcheck(torch.ops.kvboost.decoder_step.default, args,
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}


def test_one_cache_layer_at_two_indices_runs_layer_by_layer(tiny_awq, kernels_built, monkeypatch):
    """Reserving every layer first would give both indices the same row: the per-layer loop appends one after the
    other. (transformers' own forward cannot run such a cache: its masks follow the doubled length.)"""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 26), generator=torch.Generator().manual_seed(10))

    def shared_cache():
        cache = new_cache("buffered", model.config)
        cache.layers[1] = cache.layers[0]  # two sliding layers of one kind
        return cache

    with torch.no_grad():
        got, decoder_calls, _ = op_counts(lambda: decode(model, shared_cache(), ids))
        with monkeypatch.context() as patch:
            per_layer(patch)
            expected = decode(model, shared_cache(), ids)
    assert decoder_calls == 0
    assert torch.equal(got, expected)


def test_two_layers_sharing_one_buffer_run_layer_by_layer(tiny_awq, kernels_built, monkeypatch):
    """A shallow copy of a layer shares its buffer: reserving both first would give them one row (and advance the
    buffer twice), so the forward runs layer by layer."""
    model = awq_model("llama", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 26), generator=torch.Generator().manual_seed(12))

    def run():
        cache = new_cache("buffered", model.config)
        with torch.no_grad():
            out = [model(input_ids=ids[:, :12], past_key_values=cache).logits,
                   model(input_ids=ids[:, 12:13], past_key_values=cache).logits]
            cache.layers[2] = copy.copy(cache.layers[1])
            for i in range(13, 18):
                out.append(model(input_ids=ids[:, i:i + 1], past_key_values=cache).logits)
        return torch.cat(out, dim=1), [layer.get_seq_length() for layer in cache.layers]

    (got, lengths), decoder_calls, _ = op_counts(run)
    with monkeypatch.context() as patch:
        per_layer(patch)
        expected, expected_lengths = run()
    assert decoder_calls == 0
    assert torch.equal(got, expected) and lengths == expected_lengths
