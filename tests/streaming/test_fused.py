"""Fused int4 projections (``streaming.fused``): one kernel call for q/k/v and gate/up, the same bits
as separate calls, the weights held once, and correct when a model calls its projections otherwise."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvboost_hf import kernels, make_draft
from kvboost_hf.streaming.fused import ProjectionGroup, fuse_projections
from kvboost_hf.streaming.linear import AWQInt4Linear
from tests.streaming.conftest import load_awq


@pytest.fixture
def kernels_built():
    assert kernels.available().built, kernels.available().reason


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


def test_a_draft_of_a_fused_target_views_its_weights(tiny_awq, kernels_built):
    _, path = tiny_awq["gemma3"]
    target = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    draft = make_draft(target, bits=4)
    pairs = zip(_groups(target), _groups(draft))
    assert len(_groups(draft)) == len(_groups(target))
    for theirs, ours in pairs:
        assert ours.packed.data_ptr() == theirs.packed.data_ptr() and ours.side.data_ptr() == theirs.side.data_ptr()
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft), ref)
