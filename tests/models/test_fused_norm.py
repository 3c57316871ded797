"""FusedRMSNorm: RMSNorm modules become one fused call, only where that reproduces them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvboost_hf import make_draft
from kvboost_hf.models.fused_norm import FusedRMSNorm, fuse_norms, fused_equivalent
from tests.conftest import FAMILIES, make_tiny, torch_threads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_family_norm_is_reproduced(family, dtype):
    model = make_tiny(family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms
    for norm in norms:
        with torch.no_grad():
            norm.weight.normal_()  # not the all-ones / all-zeros initial weights: a wrong scale must show
        fused = fused_equivalent(norm.to(dtype), dtype)
        assert isinstance(fused, FusedRMSNorm)
        x = (torch.randn(2, 5, norm.weight.shape[0]) * 4).to(dtype)
        torch.testing.assert_close(fused(x).float(), norm(x).float(), rtol=2e-2, atol=2e-2)
        assert fused(x).dtype == dtype


class ShiftedRMSNorm(nn.Module):
    """Named like an RMSNorm but subtracting the mean (a LayerNorm): must be left alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = 1e-6

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


class GroupedRMSNorm(nn.Module):
    """An RMSNorm over groups of channels: equal to a full one on Gaussian rows only on average."""

    def __init__(self, dim: int, groups: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.groups = 1e-6, groups

    def forward(self, x):
        g = x.reshape(*x.shape[:-1], self.groups, -1).float()
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.reshape(x.shape) * self.weight).to(x.dtype)


@pytest.mark.parametrize("norm", [ShiftedRMSNorm(16), GroupedRMSNorm(64, 2)], ids=["centred", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_norm_it_cannot_reproduce_is_kept(norm, dtype):
    holder = nn.Sequential(norm)
    assert fuse_norms(holder, dtype) == 0 and holder[0] is norm


def test_drafts_use_it_and_the_target_keeps_its_own():
    model = make_tiny("gemma3")
    draft = make_draft(model, bits=8, activations=torch.float32)
    assert isinstance(draft.model.norm, FusedRMSNorm)
    assert isinstance(draft.model.layers[0].self_attn.q_norm, FusedRMSNorm)
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())


@pytest.mark.parametrize("width", [640, 4096])
def test_a_row_is_the_same_whatever_rows_and_threads_compute_with_it(width):
    norm = FusedRMSNorm(torch.rand(width) + 0.5, 1e-6)
    x = (torch.randn(256, width, generator=torch.Generator().manual_seed(width)) * 3).to(torch.bfloat16)
    for n in (1, 4):
        with torch_threads(n):
            full = norm(x)
            for rows in (1, 9, 256):
                assert torch.equal(norm(x[:rows]), full[:rows]), (n, rows)
            assert torch.equal(norm(x[100:101]), full[100:101])


def test_the_scale_stays_float32_when_the_model_changes_dtype():
    model = make_tiny("gemma3")
    with torch.no_grad():
        model.model.norm.weight.normal_(0, 0.02)
    fuse_norms(model, torch.float32)
    scale = model.model.norm.scale.clone()
    model.to(torch.bfloat16)
    assert model.model.norm.scale.dtype == torch.float32 and torch.equal(model.model.norm.scale, scale)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_a_norm_whose_output_dtype_differs_is_kept():
    class Float32Out(nn.Module):  # a norm whose float32 weight promotes a bf16 input to float32
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            self.eps = 1e-6

        def forward(self, x):
            return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    Float32Out.__name__ = "PromotingRMSNorm"
    assert fused_equivalent(Float32Out(), torch.bfloat16) is None
    assert fused_equivalent(Float32Out(), torch.float32) is not None
