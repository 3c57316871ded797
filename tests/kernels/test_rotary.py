"""The fast loop's rotary blocks (kvboost_hf.kernels.rotary): every row a block serves has the bits of the decoder's
own rotary module called for that position alone, and a module that may not take blocks is called as before."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.models.gemma3.modeling_gemma3 import Gemma3ForCausalLM
from transformers.models.llama import modeling_llama

from kvboost_hf.kernels import rotary
from kvboost_hf.kernels.rotary import BLOCK, BLOCKS_ATTR, rotary_rows

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
}


def decoder(family: str, head_dim: int, rope: dict | None = None) -> torch.nn.Module:
    common = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=4096)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_parameters=rope or ROPES["default"], **common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=16, **common))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=16,
                                                   layer_types=["sliding_attention", "full_attention"], **common))
    return model.model.eval()


def own(dec, hidden, positions, layer_type):
    return dec.rotary_emb(hidden, positions) if layer_type is None else dec.rotary_emb(hidden, positions, layer_type)


def check_rows(dec, layer_type, dtype, stops=(0, 1, 2, 63, 64, 65, 127, 130, 200, 1000, 1001)):
    hidden = torch.zeros(1, 1, 64, dtype=dtype)
    served = 0
    for first in stops:
        for count in (1, 9):
            positions = torch.arange(first, first + count).unsqueeze(0)
            got = rotary_rows(dec, hidden, positions, layer_type)
            assert got is not None
            want = own(dec, hidden, positions, layer_type)
            for g, w in zip(got, want):
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), (first, count)
            served += 1
    return served


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 256])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_every_row_a_block_serves_has_the_bits_of_a_one_position_call(family, head_dim, dtype):
    dec = decoder(family, head_dim)
    for layer_type in (("sliding_attention", "full_attention") if family == "gemma3" else (None,)):
        assert check_rows(dec, layer_type, dtype) > 0


@pytest.mark.parametrize("rope", ["linear", "llama3", "yarn"])
def test_scaled_rope_types_with_fixed_frequencies_take_blocks_with_the_same_bits(rope):
    dec = decoder("llama", 64, ROPES[rope])
    check_rows(dec, None, torch.bfloat16)
    assert dec.__dict__[BLOCKS_ATTR][None] is not None


def test_a_dynamic_rope_a_small_head_a_hooked_module_and_a_batch_call_the_module():
    hidden, one = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[5]])
    dynamic = decoder("llama", 64, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert rotary_rows(dynamic, hidden, one, None) is None  # its frequencies change with the length
    assert rotary_rows(decoder("llama", 16), hidden, one, None) is None  # ATen's scalar tail: libm's cos
    hooked = decoder("llama", 64)
    hooked.rotary_emb.register_forward_hook(lambda module, args, out: out)
    assert rotary_rows(hooked, hidden, one, None) is None
    assert rotary_rows(decoder("llama", 64), hidden, torch.tensor([[5], [5]]), None) is None
    assert rotary_rows(decoder("llama", 64), hidden, torch.arange(BLOCK + 1).unsqueeze(0), None) is None


def test_frequencies_changed_in_place_or_replaced_and_another_dtype_make_a_new_block():
    dec = decoder("llama", 64)
    hidden, positions = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[7]])
    before = rotary_rows(dec, hidden, positions, None)
    dec.rotary_emb.inv_freq.mul_(1.5)  # in place: the version counter moves
    after = rotary_rows(dec, hidden, positions, None)
    assert not torch.equal(before[0], after[0]) and torch.equal(after[0], own(dec, hidden, positions, None)[0])
    dec.rotary_emb.register_buffer("inv_freq", dec.rotary_emb.inv_freq * 0.5, persistent=False)
    replaced = rotary_rows(dec, hidden, positions, None)
    assert torch.equal(replaced[1], own(dec, hidden, positions, None)[1])
    dec.rotary_emb.attention_scaling = 0.5
    assert torch.equal(rotary_rows(dec, hidden, positions, None)[0], own(dec, hidden, positions, None)[0])
    wide = torch.zeros(1, 1, 64, dtype=torch.float32)
    got = rotary_rows(dec, wide, positions, None)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], own(dec, wide, positions, None)[0])


def test_a_module_whose_rows_depend_on_the_call_is_refused_for_good(monkeypatch):
    forward = modeling_llama.LlamaRotaryEmbedding.forward

    def shape_dependent(self, x, position_ids):
        cos, sin = forward(self, x, position_ids)
        return (cos + position_ids.shape[-1] - 1).to(cos.dtype), sin  # a one-position call is the plain result

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", shape_dependent)
    dec = decoder("llama", 64)
    hidden, positions = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[3]])
    assert rotary_rows(dec, hidden, positions, None) is None
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(rotary, "_new_block", lambda *args: calls.append(args))
        assert rotary_rows(dec, hidden, positions, None) is None and not calls  # not tried again
    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", forward)
    dec.rotary_emb = type(dec.rotary_emb)(dec.config)  # another module: tried again
    assert torch.equal(rotary_rows(dec, hidden, positions, None)[0], own(dec, hidden, positions, None)[0])


def test_edits_that_move_no_version_counter_and_forwards_set_later_are_seen(monkeypatch):
    """Found by review: an edit through ``.data`` or the storage, a ``forward`` set on the instance (as accelerate's
    hooks are) or patched on the class after a block was made, a global hook: each gives what the module gives."""
    dec = decoder("llama", 64)
    hidden, positions = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[9]])
    rot = dec.rotary_emb

    def same() -> bool:
        got = rotary_rows(dec, hidden, positions, None)
        want = own(dec, hidden, positions, None)
        return got is None or all(torch.equal(g, w) for g, w in zip(got, want))

    assert rotary_rows(dec, hidden, positions, None) is not None
    rot.inv_freq.data.mul_(0.5)
    assert same()
    rot.inv_freq.data = rot.inv_freq * 0.5
    assert same()
    rot.inv_freq.untyped_storage().copy_((rot.inv_freq * 3).untyped_storage())
    assert same()
    rot.forward = lambda x, position_ids: tuple(t * 2 for t in type(rot).forward(rot, x, position_ids))
    assert rotary_rows(dec, hidden, positions, None) is None and same()
    del rot.forward
    original = type(rot).forward
    assert rotary_rows(dec, hidden, positions, None) is not None
    monkeypatch.setattr(type(rot), "forward", lambda self, x, position_ids: tuple(
        t * 3 for t in original(self, x, position_ids)))
    assert same()
    monkeypatch.setattr(type(rot), "forward", original)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert rotary_rows(dec, hidden, positions, None) is None
    finally:
        handle.remove()


def test_frequencies_made_under_inference_mode_and_scales_that_are_not_floats():
    with torch.inference_mode():
        dec = decoder("llama", 64)  # inference tensors: no version counter
    hidden, positions = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.tensor([[4]])
    assert dec.rotary_emb.inv_freq.is_inference()
    with torch.no_grad():
        got = rotary_rows(dec, hidden, positions, None)
    assert got is not None and torch.equal(got[0], own(dec, hidden, positions, None)[0])
    dec.rotary_emb.attention_scaling = torch.tensor(1.0)  # a tensor can change in place: never a block
    assert rotary_rows(dec, hidden, positions, None) is None
    dec.rotary_emb.attention_scaling = -0.0  # -0.0 == 0.0, but the bits differ: a new block
    got = rotary_rows(dec, hidden, positions, None)
    assert torch.equal(got[0], own(dec, hidden, positions, None)[0])
    assert rotary_rows(dec, hidden, torch.zeros(1, 0, dtype=torch.long), None) is None  # no rows: the module's


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_fused_int4_decoder_serving_blocks_gives_transformers_logits(family, tmp_path, monkeypatch):
    """End to end at head size 64 (the shared tiny models' 16 never take blocks): prefill, then 70 one-row steps
    across two block edges, the fused decoder's logits against the same model's own forward."""
    from transformers import DynamicCache

    from kvboost_hf import kernels
    from kvboost_hf.kernels import decoder as fused
    from kvboost_hf.streaming.pack import pack_model
    from tests.streaming.conftest import load_awq

    if not kernels.available().built:
        pytest.fail("the kernels must build in CI")
    torch.manual_seed(3)
    common = dict(vocab_size=96, hidden_size=128, intermediate_size=128, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, num_hidden_layers=3)
    config = (LlamaConfig(**common) if family == "llama" else Gemma3TextConfig(
        sliding_window=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common))
    float_model = (LlamaForCausalLM if family == "llama" else Gemma3ForCausalLM)(config).eval()
    pack_model(float_model, tmp_path, group_size=32)
    model = load_awq(tmp_path, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    served = []
    real = rotary_rows
    monkeypatch.setattr(fused, "rotary_rows", lambda *args: served.append(real(*args)) or served[-1])
    ids = torch.randint(3, 96, (1, 76), generator=torch.Generator().manual_seed(5))

    def steps():
        cache = DynamicCache(config=model.config)
        out = [model(input_ids=ids[:, :6], past_key_values=cache).logits]
        out += [model(input_ids=ids[:, t: t + 1], past_key_values=cache).logits for t in range(6, ids.shape[1])]
        return torch.cat(out, 1)

    with torch.no_grad():
        got = steps()
        assert sum(rows is not None for rows in served) >= 70
        assert fused.unfuse_decoder(model) == 1
        want = steps()
    assert torch.equal(got, want)
