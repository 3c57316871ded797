"""The GEMM kernels against a float reference, on every ISA path this CPU has; rows, threads and
paths never change a bit."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import kernels
from kvboost_hf.kernels import pack_dense, pack_int4, pack_int8, unpack_int4
from tests.conftest import torch_threads

# (out_features, in_features, group): odd column counts pad the last block; K from one group up.
INT4_SHAPES = [(16, 32, 32), (40, 64, 32), (100, 256, 64), (48, 384, 128), (17, 128, 128), (2048, 640, 128)]


def random_int4(n: int, k: int, group: int, zero_point: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = (torch.randint(0, 16, (k // group, n), generator=gen).float() if zero_point
             else torch.full((k // group, n), 8.0))
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
    return pack_int4(codes, zeros, scales, group), codes, zeros, scales


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).float()


def close_int4(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, zeros: torch.Tensor,
               scales: torch.Tensor, group: int) -> None:
    """The int4 contract's error bound (docs/kernels.md): per group (G + 2) u s (sum |x| q + |z| sum |x|),
    plus (K / G + 1) u sum |x| |w| over the groups, u = 2^-24."""
    u, k = 2.0**-24, x.shape[-1]
    ax = x.double().abs().reshape(x.shape[0], k // group, group)  # [M, groups, G]
    q = codes.double().t().reshape(k // group, group, -1)  # [groups, G, N]
    per_group = torch.einsum("mgi,gin->mgn", ax, q) + ax.sum(-1, keepdim=True) * zeros.double().abs()
    weight = (codes.double() - zeros.t().double().repeat_interleave(group, 1)) * \
        scales.t().double().repeat_interleave(group, 1)
    bound = ((group + 2) * u * (per_group * scales.double().abs()).sum(1)
             + (k // group + 1) * u * (x.double().abs() @ weight.abs().T))
    err = (got.double() - want.double()).abs()
    assert torch.all(err <= bound), float((err / bound).max())


def close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    # fp32 accumulation error bound: K * eps * sum |x| |w|, per element
    bound = (x.double().abs() @ weight.double().abs().T).float() * (x.shape[-1] * 2.0**-23) + 1e-6
    assert torch.all((got.float() - want).abs() <= bound), float(((got.float() - want).abs() / bound).max())


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("shape", INT4_SHAPES)
def test_int4_matches_the_dequantized_weight_on_every_path(shape, zero_point, isa_paths):
    n, k, group = shape
    blocks, codes, zeros, scales = random_int4(n, k, group, zero_point, seed=n + k)
    weight = unpack_int4(blocks)
    # the layout stands for (q - z) * s, AutoAWQ's definition
    assert torch.equal(weight, (codes.float() - zeros.t().repeat_interleave(group, 1)) *
                       scales.t().repeat_interleave(group, 1))
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(7))
    outs = {}
    for isa in isa_paths:
        assert kernels.select_isa(isa) == isa
        outs[isa] = kernels.int4_linear(x, blocks)
        assert outs[isa].shape == (11, n) and outs[isa].dtype == torch.float32
        exact = x.double() @ ((codes.double() - zeros.t().double().repeat_interleave(group, 1))
                              * scales.t().double().repeat_interleave(group, 1)).T
        close_int4(outs[isa], exact, x, codes, zeros, scales, group)
    for isa in isa_paths:  # fma is exactly rounded and the order is fixed: every path gives the same bits
        assert torch.equal(outs[isa], outs["scalar"]), isa


def emulated_fp32_int4(x: torch.Tensor, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group: int) -> torch.Tensor:
    """The float32 paths' int4 contract (csrc/kvboost_kernels.h), written in torch: per group, t is the
    fma chain of x * q over the group's k in order (an fma emulated in float64, where the product of a
    float and a 4-bit code is exact: one float64 rounding, then float32's; that equals an fma except
    where |t| < 2^-52 |x q| and x q lies exactly between two floats, which randn data does not reach),
    xs the in-order float32 sum of x; then acc + s * (t - z * xs)."""
    m, k = x.shape
    acc = torch.zeros(m, codes.shape[0])
    q = codes.double().t()  # [K, N]
    for g in range(k // group):
        t = torch.zeros_like(acc)
        xs = torch.zeros(m, 1)
        for i in range(g * group, (g + 1) * group):
            t = (t.double() + x[:, i:i + 1].double() * q[i]).float()
            xs = xs + x[:, i:i + 1]
        acc = acc + scales[g] * (t - zeros[g] * xs)
    return acc


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("shape", [(40, 64, 32), (100, 256, 64), (17, 128, 128)])
def test_int4_float32_paths_are_their_definition(shape, zero_point, isa_paths):
    """Every float32 path computes the documented formula bit for bit, at one row, a few and a strip's many."""
    n, k, group = shape
    blocks, codes, zeros, scales = random_int4(n, k, group, zero_point, seed=3 * n + k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(k))
    want = emulated_fp32_int4(x, codes, zeros, scales, group)
    for isa in isa_paths:
        kernels.select_isa(isa)
        for rows in (x[:1], x[:2], x[:5], x):
            assert torch.equal(kernels.int4_linear(rows, blocks), want[:len(rows)]), (isa, len(rows))
    kernels.select_isa(None)


def test_int8_and_dense_match_their_reference_on_every_path(isa_paths):
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 96
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, generator=gen) * 0.01
    w32 = torch.randn(n, k, generator=gen)
    w16 = w32.to(torch.bfloat16)
    x = torch.randn(9, k, generator=gen)
    packs = {"int8": (pack_int8(q, s), q.float() * s[:, None]), "bf16": (pack_dense(w16), w16.float()),
             "fp32": (pack_dense(w32), w32)}
    for name, (blocks, weight) in packs.items():
        for rows in (1, 2, 9):  # one or two rows take four blocks' chains at once (70 columns: 4 blocks, then 1)
            outs = []
            for isa in isa_paths:
                kernels.select_isa(isa)
                xr = x[:rows]
                out = kernels.int8_linear(xr, blocks) if name == "int8" else kernels.dense_linear(xr, blocks)
                close(out, reference(xr, weight), xr, weight)
                outs.append(out)
            assert all(torch.equal(o, outs[0]) for o in outs), (name, rows)


def rows_kernel(kind: str, k: int = 192, n: int = 72):
    gen = torch.Generator().manual_seed(11)
    if kind == "int4":
        blocks = random_int4(n, k, 64, True, seed=5)[0]
        return lambda x: kernels.int4_linear(x, blocks)
    if kind == "int8":
        blocks = pack_int8(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n) * 0.01)
        return lambda x: kernels.int8_linear(x, blocks)
    blocks = pack_dense(torch.randn(n, k, generator=gen).to(torch.bfloat16 if kind == "bf16" else torch.float32))
    return lambda x: kernels.dense_linear(x, blocks)


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16", "fp32"])
def test_a_row_does_not_depend_on_the_rows_computed_with_it(kind, isa_paths):
    linear = rows_kernel(kind)
    x = torch.randn(300, 192, generator=torch.Generator().manual_seed(2))
    for isa in isa_paths:
        kernels.select_isa(isa)
        alone = torch.cat([linear(x[i : i + 1]) for i in range(70)])
        for m in list(range(1, 65)) + [65, 100, 256]:
            rows = linear(x[:m])
            assert torch.equal(rows, alone[:m] if m <= 70 else torch.cat([alone, linear(x[70:m])])), (isa, m)
        # and where the rows start in the batch does not matter either
        assert torch.equal(linear(x[37:300])[:33], alone[37:70]), isa


def test_any_zero_gives_the_scalar_paths_bits_at_every_row_count(isa_paths):
    # Zeros of every kind (fractional in either half of a block, -0.0, large integers, a denormal, inf, NaN)
    # meet the group's sum of x once per group (t - z * xs): every path and row tile, the same bits, NaNs too.
    gen = torch.Generator().manual_seed(9)
    n, k, group = 80, 320, 32
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(-3, 19, (k // group, n), generator=gen).float()
    zeros[1, 3::16] += 0.5  # the low 8 columns of each block only
    zeros[8, 12::16] -= 0.25  # the high 8 only
    zeros[9, 5::7] += 0.75
    zeros[2, :] = -0.0
    zeros[3, 5] = 2.0**22
    zeros[3, 6] = -(2.0**22)
    zeros[4, 40:] = 2.0**25 - 2
    zeros[5, 17] = float("inf")
    zeros[6, 33] = float("nan")
    zeros[7, :16] = 1e-30
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    blocks = pack_int4(codes, zeros, scales, group)
    x = torch.randn(13, k, generator=gen)
    want = {m: None for m in range(1, 14)}
    for isa in isa_paths:
        kernels.select_isa(isa)
        for m in want:
            got = kernels.int4_linear(x[:m], blocks)
            if want[m] is None:
                want[m] = got  # the scalar path comes first
            assert torch.equal(got.view(torch.int32), want[m].view(torch.int32)), (isa, m)  # NaNs too
            # and a row alone is the row in a batch
            assert torch.equal(got[:1].view(torch.int32), want[1].view(torch.int32)), (isa, m)
    assert want[13].isnan().any() and want[13].isfinite().any()


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16", "fp32", "row-major"])
def test_thread_count_never_changes_a_bit(kind, built):
    """Each thread takes its own run of column chunks, then chunks from the back of the others' runs (a chunk per
    thread, more chunks than threads, a last chunk cut short: 2048 columns, and 80 for fewer chunks than some thread
    counts; 3 and 7 threads on fewer cores are descheduled in turn, so they take from each other's runs); no count
    changes a bit, and no chunk is left out (a missing one would leave the output's memory as it was)."""
    gen = torch.Generator().manual_seed(4)
    for n in (2048, 80):
        if kind == "row-major":
            weight = torch.randn(n, 640, generator=gen).to(torch.bfloat16)
            linear = lambda x: kernels.linear(x, weight)  # noqa: E731
        else:
            linear = rows_kernel(kind, k=640, n=n)
        for m in (1, 9, 20):
            x = torch.randn(m, 640, generator=gen)
            outs = []
            for t in (1, 2, 3, 7):
                with torch_threads(t):
                    outs.append(linear(x))
            assert all(torch.equal(o, outs[0]) for o in outs), (kind, n, m)


def test_bf16_activations_give_bf16_outputs_of_the_float_result(isa_paths):
    blocks = random_int4(48, 128, 32, True, seed=1)[0]
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    for isa in isa_paths:
        kernels.select_isa(isa)
        out = kernels.int4_linear(x, blocks)
        assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
        if isa != "avx512_bf16":  # that one has its own numerics for bf16 activations (tested below)
            assert torch.equal(out, kernels.int4_linear(x.float(), blocks).to(torch.bfloat16))


def test_bad_inputs_say_what_to_change(built):
    blocks = random_int4(32, 64, 32, True, seed=1)[0]
    with pytest.raises(ValueError, match="input has 63 features, the weight expects 64"):
        kernels.int4_linear(torch.randn(1, 63), blocks)
    with pytest.raises(RuntimeError, match="group_size 48 must divide in_features 64"):
        torch.ops.kvboost.int4_linear(torch.randn(1, 64), blocks.qweight, blocks.scales, blocks.zeros, 48, 32)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        kernels.int4_linear(torch.ones(1, 64, dtype=torch.int32), blocks)
    with pytest.raises(ValueError, match="group_size must be even and divide in_features 48, got 32"):
        pack_int4(torch.zeros(16, 48, dtype=torch.long), torch.zeros(1, 16), torch.ones(1, 16), 32)
    # rows k and k + 1 share a byte: an odd group would give a pair two groups' scales
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(torch.zeros(16, 6, dtype=torch.long), torch.zeros(2, 16), torch.ones(2, 16), 3)
    sides = torch.ones(2, 64, 16)
    with pytest.raises(RuntimeError, match="int4 group_size must be even"):
        torch.ops.kvboost.int4_linear(torch.randn(1, 64), blocks.qweight, sides, sides, 1, 32)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((16, 32), 16), torch.zeros(1, 16), torch.ones(1, 16), 32)
    with pytest.raises(ValueError, match="isa must be one of"):
        kernels.select_isa("sse9")


def test_no_rows_give_no_rows_on_every_path(isa_paths):
    """An empty batch (a zero-length chunk) gives an empty result; it crashed the few-row tiles before."""
    blocks = random_int4(64, 64, 32, True, seed=2)[0]
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    int8 = pack_int8(q, torch.rand(48, generator=gen))
    dense = pack_dense(torch.randn(48, 64, generator=gen).to(torch.bfloat16))
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    try:
        for isa in isa_paths:
            kernels.select_isa(isa)
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.empty(0, 64, dtype=dtype)
                assert kernels.int4_linear(x, blocks).shape == (0, 64), isa
                assert kernels.int8_linear(x, int8).shape == (0, 48), isa
                assert kernels.dense_linear(x, dense).shape == (0, 48), isa
                assert kernels.linear(x, weight.to(dtype)).shape == (0, 48), isa
    finally:
        kernels.select_isa(None)


def test_ops_trace_under_torch_compile(built):
    blocks = random_int4(48, 128, 32, True, seed=2)[0]
    dense = pack_dense(torch.randn(40, 48))

    def f(x):
        return kernels.dense_linear(torch.relu(kernels.int4_linear(x, blocks)), dense)

    x = torch.randn(5, 128)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_major_linear_matches_reference_rows_and_paths(dtype, isa_paths):
    """nn.Linear's own [N, K] weight (the tied LM head): its own fixed order, same guarantees."""
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(203, 160, generator=gen).to(dtype)
    bias = torch.randn(203, generator=gen)
    x = torch.randn(40, 160, generator=gen)
    outs = []
    for isa in isa_paths:
        kernels.select_isa(isa)
        out = kernels.linear(x, weight)
        close(out, reference(x, weight.float()), x, weight.float())
        alone = torch.cat([kernels.linear(x[i : i + 1], weight) for i in range(40)])
        assert torch.equal(out, alone), isa
        for m in range(1, 40):  # every pass size, and passes of several sizes after one another
            assert torch.equal(kernels.linear(x[:m], weight), out[:m]), (isa, m)
        # many 9-row blocks of the AVX-512 path's interleaved copy of x (gemm_body.inc), against pieces of 40 rows
        many = torch.randn(450, 160, generator=gen)
        pieces = torch.cat([kernels.linear(many[i : i + 40], weight) for i in range(0, 450, 40)])
        assert torch.equal(kernels.linear(many, weight), pieces), isa
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(kernels.linear(x, weight, bias), outs[0] + bias)
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 16"):
        kernels.linear(torch.randn(1, 20), torch.randn(8, 20))


def test_kernel_linear_adopts_a_tied_head_without_copying():
    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    adopted = kernels.KernelLinear.adopt(head)
    assert adopted.weight is emb.weight and isinstance(adopted, torch.nn.Linear)
    x = torch.randn(3, 32)
    close(adopted(x), reference(x, emb.weight.detach()), x, emb.weight.detach())
    with pytest.raises(TypeError, match="plain nn.Linear"):
        kernels.KernelLinear.adopt(adopted)
