"""FusedRMSNorm: RMSNorm modules become one fused call, only where that reproduces them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvboost_hf import make_draft
from kvboost_hf.models.fused_norm import FusedRMSNorm, fuse_norms, fused_equivalent
from tests.conftest import FAMILIES, make_tiny


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
