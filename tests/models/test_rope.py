import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from kvboost_hf.models.rope import RopeShifter, UnsupportedRope
from tests.conftest import make_tiny, random_ids


def layer0_keys(model, ids, offset):
    cache = DynamicCache(config=model.config)
    positions = torch.arange(ids.shape[1]).unsqueeze(0) + offset
    with torch.no_grad():
        model(ids, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache.layers[0].keys


def check_shifts(model, ids):
    shifter = RopeShifter.for_model(model)
    at_p = layer0_keys(model, ids, 3)
    for q in (3 + 50, 3 + 200, 3 + 700):
        direct = layer0_keys(model, ids, q)
        moved = shifter.shift(at_p, q - 3, 0)
        err = (moved - direct).abs().max().item()
        # fp32 angles: the model's own key at q carries ~ulp(q * theta) of rounding, so far moves
        # are held to 1e-4 relative to the keys' scale, near ones to 1e-4 absolute.
        assert err <= (1e-4 if q < 300 else 1e-4 * direct.abs().max().item()), (q, err)
        back = shifter.shift(moved, 3 - q, 0)
        assert (back - at_p).abs().max().item() <= 1e-5
    return shifter


def test_shift_matches_direct_computation_on_each_family(tiny):
    check_shifts(tiny, random_ids(12, 0))


def test_gemma_shift_on_both_layer_types(gemma_model):
    model, _ = gemma_model
    ids = torch.randint(1000, 20000, (1, 16), generator=torch.Generator().manual_seed(0))
    shifter = check_shifts(model, ids)
    full = model.config.layer_types.index("full_attention")
    cache_p, cache_q = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache_p, use_cache=True)
        model(ids, position_ids=torch.arange(16).unsqueeze(0) + 300, past_key_values=cache_q, use_cache=True)
    # Deeper layers' keys depend on context, not only position; the full layer's *rotation* must
    # still use the 1e6 base: shifting with the sliding (1e4) base would be far off.
    moved = shifter.shift(cache_p.layers[full].keys, 300, full)
    wrong = shifter.shift(cache_p.layers[full].keys, 300, 0)
    true = cache_q.layers[full].keys
    assert (moved - true).abs().mean() < (wrong - true).abs().mean()


@pytest.mark.parametrize(
    "rope, reason",
    [
        ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "dynamic"),
        ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
          "original_max_position_embeddings": 64}, "longrope"),
    ],
)
def test_non_rotation_rope_types_are_refused(rope, reason):
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    with pytest.raises(UnsupportedRope, match=reason):
        RopeShifter.for_model(LlamaForCausalLM(config))


def test_absolute_positions_are_refused():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedRope, match="absolute"):
        RopeShifter.for_model(model)


def test_mla_is_refused():
    model = make_tiny("llama")
    model.config.kv_lora_rank = 16
    with pytest.raises(UnsupportedRope, match="MLA"):
        RopeShifter.for_model(model)


def test_a_layer_type_without_rope_leaves_the_others_read():
    """Per-layer-type parameters with a None entry (a layer type without RoPE) were read as one flat dict, which
    reported the default type and hid a dynamic one."""
    from kvboost_hf.models.rope import _rope_types

    class Config:
        rope_parameters = {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0}, "full_attention": None}

    assert _rope_types(Config()) == {"dynamic"}
