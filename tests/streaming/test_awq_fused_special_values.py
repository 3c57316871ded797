"""The fused layer ops' bf16 loops (RoPE, the projections' rounding, residual adds and products, RMSNorm's
rounding: AVX-512 where the path has it, scalar otherwise) give the bits of the layers' own modules on values that
round at the edges: infinities, NaN, subnormals, huge and tiny rows."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvboost_hf import kernels
from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
from kvboost_hf.streaming import StreamingAWQConfig

pytestmark = pytest.mark.usefixtures("two_threads")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN where the other is NaN (its payload aside: torch's vectorized casts give 0xFFFF, c10's scalar 0x7FC0),
    every other value bit for bit."""
    nan = torch.isnan(a)
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(view), b[~nan].view(view))


def special_rows(rows: int, hidden: int) -> torch.Tensor:
    """Normal rows scaled to the edges of bf16's range; the last row holds a NaN (causal: only it turns NaN)."""
    x = torch.randn(1, rows, hidden, generator=torch.Generator().manual_seed(11))
    scales = torch.tensor([1.0, 1e30, 1e-30, 3e38, 1e-38, 2.0**-126, 1.0, 65504.0])
    x = x * scales.repeat(rows // len(scales) + 1)[:rows].view(1, rows, 1)
    x[0, 3, :4] = float("inf")
    x[0, 3, 4:8] = -float("inf")
    x[0, -1, 5] = float("nan")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fused_layers_give_the_modules_bits_on_edge_values(family, tiny_awq):
    assert kernels.available().built
    config = StreamingAWQConfig(residency_mode="full_resident", kernel="kvboost")
    model = AutoModelForCausalLM.from_pretrained(tiny_awq[family][1], dtype=torch.bfloat16, quantization_config=config)
    embeds = special_rows(24, model.config.hidden_size)
    try:
        for isa in kernels.ISA_LEVELS[: kernels.ISA_LEVELS.index(kernels.host_isa()) + 1]:
            kernels.select_isa(isa)
            with torch.no_grad():
                fuse_layers(model)
                fused = model(inputs_embeds=embeds).logits
                unfuse_layers(model)
                plain = model(inputs_embeds=embeds).logits
            assert torch.isnan(fused[0, -1]).all() and not torch.isnan(fused[0, 0]).any()  # the edges were reached
            assert same_bits(fused, plain), isa
    finally:
        kernels.select_isa(None)
        fuse_layers(model)


def test_rms_norm_rounds_edge_values_alike_on_every_path():
    assert kernels.available().built
    x = special_rows(16, 96)[0]
    scale = torch.rand(96, generator=torch.Generator().manual_seed(12)) * 1e-36  # subnormal and tiny outputs
    scale[:8] = torch.tensor([1.0, 1e38, 3.0, -2.0, 0.0, 1e-45, 7e-39, 1.5])
    try:
        outs = []
        for isa in kernels.ISA_LEVELS[: kernels.ISA_LEVELS.index(kernels.host_isa()) + 1]:
            kernels.select_isa(isa)
            outs.append(kernels.ops.rms_norm(x, scale, 1e-6))
        want = kernels.ops.rms_norm(x.float(), scale, 1e-6).to(torch.bfloat16)  # float32 out, torch's rounding
        for out in outs:  # every path computes the same float32 values (the norm's contract); then the rounding
            assert same_bits(out, want)
        assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)  # NaN too
    finally:
        kernels.select_isa(None)
