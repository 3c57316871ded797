"""The RMSNorm op against a float64 reference on every ISA path; rows, threads and paths never change a
bit; ``KernelRMSNorm`` stands in for a model's norm and names its numerics in the store namespace."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import kernels
from kvboost_hf.kernels import ops
from kvboost_hf.kernels.norm import KernelRMSNorm, cpu_norm
from kvboost_hf.models.fused_norm import FusedRMSNorm, fuse_norms
from tests.conftest import make_tiny, torch_threads


def reference(x, scale, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale.double()


@pytest.mark.parametrize("width", [16, 40, 640, 4096])
def test_matches_a_float64_reference_and_every_path_gives_the_same_bits(width, isa_paths):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=gen) * 3
    scale = torch.rand(width, generator=gen) + 0.5
    outs = {}
    for isa in isa_paths:
        kernels.select_isa(isa)
        outs[isa] = ops.rms_norm(x, scale, 1e-6)
        assert (outs[isa].double() - reference(x, scale, 1e-6)).abs().max() < 1e-5 * x.abs().max()
    assert all(torch.equal(out, outs["scalar"]) for out in outs.values())
    for dtype in (torch.bfloat16, torch.float16):  # computed in float32, rounded once to the input's dtype
        assert torch.equal(ops.rms_norm(x.to(dtype), scale, 1e-6), ops.rms_norm(x.to(dtype).float(), scale, 1e-6).to(dtype))


def test_a_row_does_not_depend_on_rows_threads_or_layout(built):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 640, generator=gen).to(torch.bfloat16)
    scale = torch.rand(640, generator=gen) + 0.5
    alone = torch.cat([ops.rms_norm(x[i : i + 1], scale, 1e-6) for i in range(64)])
    for n in (1, 2, 4):
        with torch_threads(n):
            assert torch.equal(ops.rms_norm(x, scale, 1e-6), alone)
            assert torch.equal(ops.rms_norm(x.view(8, 8, 640), scale, 1e-6).view(64, 640), alone)
            strided = x.t().contiguous().t()  # not contiguous: copied, same bits
            assert torch.equal(ops.rms_norm(strided, scale, 1e-6), alone)


def test_bad_inputs_say_what_to_change(built):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="scale must be a contiguous float32"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match=r"scale must be .*\[8\]"):
        ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.rms_norm(x.double(), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="not implemented"):
        ops.rms_norm(x.requires_grad_(True), torch.ones(8), 1e-6).sum().backward()
    strided = torch.randn(7, 4, 33).transpose(0, 1)  # the result is contiguous, its fake too
    for args in ((x.detach(), torch.ones(8), 1e-6), (strided, torch.ones(33), 1e-6)):
        torch.library.opcheck(torch.ops.kvboost.rms_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    f = lambda x: ops.rms_norm(x, torch.ones(33), 1e-6) * 2  # noqa: E731
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(strided), f(strided))
    norm = KernelRMSNorm(torch.ones(8), 1e-6)  # float64 (no kernel path): computed as FusedRMSNorm does
    assert torch.equal(norm(x.detach().double()), FusedRMSNorm.forward(norm, x.detach().double()))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_kernel_norms_stand_in_for_a_models_norms_and_name_their_numerics(family, built):
    from kvboost_hf.models.namespace import namespace

    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(2))
    models = {}
    for norm in (FusedRMSNorm, KernelRMSNorm):
        model = make_tiny(family, seed=6).to(torch.bfloat16)
        with torch.no_grad():
            reference_logits = model(ids).logits.float()
        assert fuse_norms(model, torch.bfloat16, norm) > 0
        assert all(type(m) is not FusedRMSNorm or norm is FusedRMSNorm
                   for m in model.modules() if isinstance(m, FusedRMSNorm))
        with torch.no_grad():
            logits = model(ids).logits.float()
        assert (logits - reference_logits).abs().max() < 0.05 * reference_logits.abs().max()  # other rounding only
        models[norm] = model
    assert namespace(models[FusedRMSNorm]) != namespace(models[KernelRMSNorm])  # their K/V never mix
    assert cpu_norm() is KernelRMSNorm
