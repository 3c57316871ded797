"""Fused int4 projections (``streaming.fused``): one kernel call for q/k/v and gate/up, the same bits
as separate calls, the weights held once, and correct when a model calls its projections otherwise."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from kvboost_hf import make_draft
from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
from kvboost_hf.streaming.fused import ProjectionGroup, fuse_projections
from kvboost_hf.streaming.linear import AWQInt4Linear
from tests.streaming.conftest import load_awq


def _groups(model) -> list[ProjectionGroup]:
    return list({id(m.group): m.group for m in model.modules() if isinstance(m, AWQInt4Linear) and m.group}.values())


def _unfused(model) -> None:
    for module in model.modules():
        if isinstance(module, AWQInt4Linear):
            module.group = None


def _logits(model, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Logits of the last ``rows`` tokens of ``ids`` after a prefill of the rest."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :-rows], past_key_values=cache, use_cache=True)
        return model(input_ids=ids[:, -rows:], past_key_values=cache, use_cache=True).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_projections_give_the_bits_of_separate_calls(family, dtype, tiny_awq, kernels_built):
    _, path = tiny_awq[family]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost", dtype=dtype)
    layers = model.config.num_hidden_layers
    groups = _groups(model)
    assert len(groups) == 2 * layers and fuse_projections(model) == 0  # q/k/v and gate/up per layer; idempotent
    for group in groups:  # the members' weights are views of the group's: held once
        for member in group.members:
            assert member.int4_weight.untyped_storage().data_ptr() == group.packed.untyped_storage().data_ptr()
    ids = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(7))
    fused = {rows: _logits(model, ids, rows) for rows in (1, 7)}
    _unfused(model)
    for rows, logits in fused.items():
        assert torch.equal(_logits(model, ids, rows), logits), rows


def test_a_member_called_on_another_input_computes_its_own(tiny_awq, kernels_built):
    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(1, 3, attn.q_proj.in_features, generator=gen).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        expected = {}
        for name in ("q_proj", "k_proj", "v_proj"):
            module = getattr(attn, name)
            group, module.group = module.group, None
            expected[name, "x"], expected[name, "y"] = module(x), module(y)
            module.group = group
        attn.q_proj(x)
        assert torch.equal(attn.k_proj(y), expected["k_proj", "y"])  # not x's pending output
        assert torch.equal(attn.v_proj(x), expected["v_proj", "x"])  # x's output is still waiting for it
        attn.q_proj(x)
        x.mul_(2)  # the same tensor, changed in place: the pending outputs are stale
        assert torch.equal(attn.k_proj(x), getattr(attn.k_proj.group, "kernel").matmul(
            x.reshape(-1, x.shape[-1]), attn.k_proj.int4_weight, attn.k_proj.int4_scales_zeros,
            attn.k_proj.group_size, attn.k_proj.out_features).reshape(1, 3, -1))


def test_torch_kernel_and_streamed_layers_are_not_fused(tiny_awq, mmap_dir, kernels_built):
    _, path = tiny_awq["gemma3"]
    assert not _groups(load_awq(path, residency_mode="full_resident", kernel="torch"))
    model = load_awq(path, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, kernel="kvboost",
                     mmap_dir=str(mmap_dir))
    fused_layers = {int(name.split(".")[2]) for name, m in model.named_modules()
                    if isinstance(m, AWQInt4Linear) and m.group is not None}
    assert fused_layers == {0, model.config.num_hidden_layers - 1}


def test_a_decode_step_makes_one_call_per_group(tiny_awq, kernels_built, monkeypatch):
    _, path = tiny_awq["gemma3"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    unfuse_layers(model)  # the layers' own forward, whose projections call the kernel (fused layers call the op)
    kernel = _groups(model)[0].kernel
    calls = []
    real = type(kernel).matmul
    monkeypatch.setattr(type(kernel), "matmul", lambda self, *a: calls.append(a[-1]) or real(self, *a))
    _logits(model, torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1)), 1)
    per_layer = len(calls) // model.config.num_hidden_layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    # prefill and decode step: q/k/v, o, gate/up and down each once per layer and forward
    assert per_layer == 8 and calls[:4] == [qkv, attn.o_proj.out_features, 2 * mlp.up_proj.out_features,
                                            mlp.down_proj.out_features]


def test_a_draft_of_a_fused_target_views_its_weights_and_fuses_exactly(tiny_awq, kernels_built):
    _, path = tiny_awq["gemma3"]
    target = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    draft = make_draft(target, bits=4)
    pairs = zip(_groups(target), _groups(draft))
    assert len(_groups(draft)) == len(_groups(target))
    for theirs, ours in pairs:
        assert ours.packed.data_ptr() == theirs.packed.data_ptr() and ours.side.data_ptr() == theirs.side.data_ptr()
        assert not set(ours.members) & set(theirs.members)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    fused = {rows: _logits(draft, ids, rows) for rows in (1, 5)}
    _unfused(draft)
    for rows, logits in fused.items():  # wrong offsets into the target's tensors would show here
        assert torch.equal(_logits(draft, ids, rows), logits), rows


def test_inference_mode_and_copies(tiny_awq, kernels_built):
    import copy
    import pickle

    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(4))
    expected = _logits(model, ids, 1)
    with torch.inference_mode():  # inference tensors have no version counter
        assert torch.equal(_logits(model, ids, 1), expected)
    draft = make_draft(model, bits=4)
    assert _groups(draft)
    for clone in (copy.deepcopy(draft), pickle.loads(pickle.dumps(draft))):
        assert _groups(clone) and torch.equal(_logits(clone, ids, 1), _logits(draft, ids, 1))
        assert type(clone.model.layers[0]) is LlamaDecoderLayer  # copied as the layer's own class
        assert fuse_layers(clone) == len(clone.model.layers)
        assert torch.equal(_logits(clone, ids, 1), _logits(draft, ids, 1))


def test_replaced_weights_dissolve_the_group(tiny_awq, kernels_built):
    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    other = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(5))
    mlp = other.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.int4_weight.copy_(mlp.up_proj.int4_weight.flip(0))  # a different weight, shared storage
    changed = _logits(other, ids, 1)
    assert not torch.equal(changed, _logits(model, ids, 1))
    target = model.model.layers[1].mlp.up_proj
    target.int4_weight = mlp.up_proj.int4_weight.clone()  # assigned anew, not copied into the view
    assert torch.equal(_logits(model, ids, 1), changed)  # a fused layer reads its arguments again
    unfuse_layers(model)  # the layers' own forward: the group sees its member's weight replaced
    assert torch.equal(_logits(model, ids, 1), changed) and target.group is None
    attn = model.model.layers[0].self_attn
    attn.k_proj.set_weight(attn.k_proj.int4_weight.clone(), attn.k_proj.int4_scales_zeros.clone())
    assert attn.q_proj.group is None and attn.v_proj.group is None


def test_a_group_whose_members_take_other_inputs_dissolves(tiny_awq, kernels_built):
    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(4):  # cross-attention style: q on one tensor, k and v on another
            x, y = (torch.randn(1, 2, attn.q_proj.in_features, generator=gen).to(torch.bfloat16) for _ in range(2))
            attn.q_proj(x), attn.k_proj(y), attn.v_proj(y)
    assert attn.q_proj.group is None and attn.k_proj.group is None


def test_a_traced_forward_computes_each_member_alone(tiny_awq, kernels_built):
    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def projections(h):
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    with torch.no_grad():
        eager = projections(x)
        traced = torch.compile(projections, backend="eager", fullgraph=True)(x)  # no graph break on the group
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert attn.q_proj.group is not None  # tracing leaves the group alone
