"""The bf16-activation paths, whose int4 numerics are their own: avx512_bf16 (vdpbf16ps) against its definition
written in torch, bit for bit; amx_bf16 (AMX tiles) rows bit-independent and close to that definition; both
falling back to the best path there is on CPUs without them."""

from __future__ import annotations

import pytest
import torch

from kvboost_hf import kernels
from tests.conftest import torch_threads
from tests.kernels.test_gemm import random_int4


def emulated_bf16_path(x: torch.Tensor, blocks) -> torch.Tensor:
    """The avx512_bf16 path's definition in torch, one rounded float32 operation at a time: per group,
    t sums x * q over the group's k-pairs in order, the odd element of a pair first (a bf16 x code
    product is exact), xs sums x alone the same way, then acc = acc + s * (t - z * xs)."""
    nb, k = blocks.qweight.shape[:2]
    pairs = blocks.qweight.reshape(nb, k // 2, 1, 16)
    q = torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(nb, k, 16).transpose(1, 2).reshape(-1, k).float()
    g = blocks.group_size
    s = blocks.scales.transpose(0, 1).reshape(k // g, -1)  # [K/G, NB*16]
    z = blocks.zeros.transpose(0, 1).reshape(k // g, -1)
    xf = x.float()
    acc = torch.zeros(x.shape[0], q.shape[0])
    for gi in range(k // g):
        t = torch.zeros_like(acc)
        xs = torch.zeros(x.shape[0], 1)
        for p in range(gi * g, (gi + 1) * g, 2):
            for i in (p + 1, p):
                t = t + xf[:, i : i + 1] * q[:, i]
                xs = xs + xf[:, i : i + 1]
        acc = acc + s[gi] * (t - z[gi] * xs)
    return acc[:, : blocks.out_features]


def has_path(built, isa: str) -> bool:
    return kernels.ISA_LEVELS.index(built.host_isa) >= kernels.ISA_LEVELS.index(isa)


def assert_bf16_path_falls_back(built, run) -> None:
    """On a CPU without AVX-512 BF16, asking for that path gives the best path there is, with the
    float32 paths' bits (those of the scalar path)."""
    try:
        assert kernels.select_isa("avx512_bf16") == built.host_isa
        got = run()
        kernels.select_isa("scalar")
        assert torch.equal(got, run())
    finally:
        kernels.select_isa(None)


def test_the_avx512_bf16_path_is_its_definition_and_keeps_rows_independent(built):
    if not has_path(built, "avx512_bf16"):
        blocks = random_int4(32, 64, 32, True, seed=6)[0]
        x = torch.randn(3, 64).to(torch.bfloat16)
        assert_bf16_path_falls_back(built, lambda: kernels.int4_linear(x, blocks))
        return
    try:
        kernels.select_isa("avx512_bf16")
        blocks = random_int4(72, 256, 64, True, seed=6)[0]
        x = torch.randn(70, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        out = torch.ops.kvboost.int4_linear(x, blocks.qweight, blocks.scales, blocks.zeros, 64, 72)
        assert out.dtype == torch.bfloat16
        raw = emulated_bf16_path(x, blocks)
        assert torch.equal(out, raw.to(torch.bfloat16))
        # codes decoded in registers up to 12 rows (4 without VBMI, as on Cooper Lake), into a strip above
        for vbmi in (True, False):
            kernels.set_vbmi(vbmi)
            for m in (*range(1, 14), 17, 64):
                assert torch.equal(kernels.int4_linear(x[:m], blocks), out[:m]), (vbmi, m)
        kernels.set_vbmi(True)
        with torch_threads(1):
            assert torch.equal(kernels.int4_linear(x, blocks), out)
        # float32 activations keep the float32 paths' bits on this level
        xf = x.float()
        fp32 = kernels.int4_linear(xf, blocks)
        kernels.select_isa("scalar")
        assert torch.equal(kernels.int4_linear(xf, blocks), fp32)
    finally:
        kernels.select_isa(None)
        kernels.set_vbmi(True)


def test_the_avx512_bf16_int4_sums_start_from_plus_zero_in_every_tile(built):
    """acc = +0, then + s * (t - z * xs) per group: with zero activations and negative scales every group adds -0,
    so the output is +0 only where the sums start from +0 (a tile starting from -0, or from memory left in the
    output, shows here). Every row count's tile (registers with their sums in registers or in the output, strips;
    VBMI or not), 7 blocks (pairs and one alone), 4 groups."""
    if not has_path(built, "avx512_bf16"):
        return  # the fallback is tested above
    k, group, n = 256, 64, 104
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = -(torch.rand(k // group, n, generator=gen) * 0.02 + 0.001)
    blocks = kernels.pack_int4(codes, zeros, scales, group)
    x = torch.zeros(70, k, dtype=torch.bfloat16)
    try:
        kernels.select_isa("avx512_bf16")
        for vbmi in (True, False):
            kernels.set_vbmi(vbmi)
            for m in (*range(1, 14), 16, 70):
                bits = kernels.int4_linear(x[:m], blocks).view(torch.int16)
                assert bool((bits == 0).all()), (vbmi, m)
    finally:
        kernels.select_isa(None)
        kernels.set_vbmi(True)


def set_order_trap(row: torch.Tensor, first: int, later: int, e: int, sign: float = 1.0) -> None:
    """In ``row`` (float32), the k-pair at ``first`` (its even k) gets sign 2^e at its odd k and sign 2^(e-24) at
    its even k (absorbed: a tie, to even), the pair at ``later`` -sign 2^e at its odd k. Summed odd k first, pairs
    in order, these end at 0; summed in another order (the later pair first, or the small term first) they end at
    sign 2^(e-24)."""
    row[first + 1], row[first], row[later + 1] = sign * 2.0**e, sign * 2.0 ** (e - 24), -sign * 2.0**e


def order_traps(m: int, k: int, group: int, seed: int) -> torch.Tensor:
    """bf16 activations whose pair sums show their order at any precision: per row and group, 2^e at the odd k of
    one pair with 2^(e-24) beside it (absorbed: a tie, to even) and -2^e at the odd k of a later pair, zeros
    elsewhere. In the defined order (pairs in order, the odd element first) such a chain ends at 0; with the
    pairs in another order, or the small term first, it ends at 2^(e-24)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(m, k)
    for r in range(m):
        for g0 in range(0, k, group):
            p1, p2 = sorted(torch.randperm(group // 2, generator=gen)[:2].tolist())
            e = int(torch.randint(24, 28, (1,), generator=gen))
            sign = float(torch.randint(0, 2, (1,), generator=gen)) * 2 - 1
            set_order_trap(x[r], g0 + 2 * p1, g0 + 2 * p2, e, sign)
    return x.to(torch.bfloat16)


def test_the_avx512_bf16_int4_chains_run_in_the_defined_order(built):
    """The random test above compares bf16 outputs, where a float32 sum in another order nearly always rounds the
    same; here the order shows. Codes 1 (so each chain is the activations' own), random scales and zeros, 7 blocks
    (a run of 4 and 3 left: a pair and one alone), every row count's kernel (registers, strips; VBMI or not) and one
    thread."""
    if not has_path(built, "avx512_bf16"):
        return  # no such path here: its fallback is the test above's
    k, group, n = 256, 64, 104
    codes = torch.ones(n, k, dtype=torch.long)
    gen = torch.Generator().manual_seed(3)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
    blocks = kernels.pack_int4(codes, zeros, scales, group)
    x = order_traps(70, k, group, seed=4)
    want = emulated_bf16_path(x, blocks).to(torch.bfloat16)
    backwards = emulated_bf16_path(x.flip(1), kernels.pack_int4(codes, zeros.flip(0), scales.flip(0), group))
    assert (backwards.to(torch.bfloat16) != want).float().mean() > 0.9  # the traps do show another order
    try:
        kernels.select_isa("avx512_bf16")
        for vbmi in (True, False):
            kernels.set_vbmi(vbmi)
            for m in (*range(1, 14), 16, 17, 64, 70):
                assert torch.equal(kernels.int4_linear(x[:m], blocks).view(torch.int16), want[:m].view(torch.int16)), (vbmi, m)
        with torch_threads(1):
            assert torch.equal(kernels.int4_linear(x, blocks).view(torch.int16), want.view(torch.int16))
    finally:
        kernels.select_isa(None)
        kernels.set_vbmi(True)


def emulated_bf16_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The avx512_bf16 path for a row-major bf16 weight and bf16 activations, written in torch: lane j
    of chunk c takes k = 32c + 2j + 1 then 32c + 2j (exact products, one rounding per sum), then the
    fixed tree over the 16 lanes."""
    m, k = x.shape
    xs = x.float().reshape(m, 1, k // 32, 16, 2)
    ws = weight.float().reshape(1, -1, k // 32, 16, 2)
    acc = torch.zeros(m, weight.shape[0], 16)
    for c in range(k // 32):
        acc = acc + xs[:, :, c, :, 1] * ws[:, :, c, :, 1]
        acc = acc + xs[:, :, c, :, 0] * ws[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    return acc[..., 0]


def test_the_avx512_bf16_row_major_path_is_its_definition(built):
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(70, 192, generator=gen).to(torch.bfloat16)
    x = torch.randn(20, 192, generator=gen).to(torch.bfloat16)
    if not has_path(built, "avx512_bf16"):
        assert_bf16_path_falls_back(built, lambda: kernels.linear(x, weight))
        return
    try:
        kernels.select_isa("avx512_bf16")
        out = kernels.linear(x, weight)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, emulated_bf16_rows(x, weight).to(torch.bfloat16))
        for passes in (0, 9, 20):  # one weight row a pass up to that many rows (two from 4 rows on beyond)
            kernels.set_one_row_passes(passes)
            assert torch.equal(kernels.linear(x, weight), out), passes
            for m in (1, 2, 4, 5, 6, 9, 10, 13, 18, 19):  # 13, 18: a later 9-row block of 4 or 9 rows
                assert torch.equal(kernels.linear(x[:m], weight), out[:m]), (passes, m)
        kernels.set_one_row_passes(None)
        kernels.select_isa("avx512")  # float32 activations, or another path: the float32 order
        assert torch.equal(kernels.linear(x, weight), kernels.linear(x.float(), weight).to(torch.bfloat16))
        if has_path(built, "amx_bf16"):  # AMX changes int4 only: row-major bf16 weights as avx512_bf16
            kernels.select_isa("amx_bf16")
            assert torch.equal(kernels.linear(x, weight), out)
    finally:
        kernels.select_isa(None)
        kernels.set_one_row_passes(None)


def cpuinfo_field(name: str) -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.split(":")[0].strip() == name:
                return line.split(":", 1)[1].strip()
    return ""


def test_one_row_passes_are_the_hosts_choice_until_set(built):
    """Up to 9 rows on AMD from family 26 (Zen 5) on, where one weight row a pass was measured faster; 0 elsewhere."""
    zen5 = cpuinfo_field("vendor_id") == "AuthenticAMD" and int(cpuinfo_field("cpu family") or 0) >= 26
    host = kernels.set_one_row_passes(None)
    assert host == (9 if zen5 else 0)
    try:
        assert kernels.set_one_row_passes(3) == 3
        for wrong in (-1, True, 2.0, 2**40):
            with pytest.raises(ValueError, match="row count >= 0 or None"):
                kernels.set_one_row_passes(wrong)
    finally:
        assert kernels.set_one_row_passes(None) == host


def test_the_row_major_bf16_chunks_run_in_the_defined_order(built):
    """The lane trees' test above puts its values in different lanes; here they share one, in different chunks:
    2^e at the odd k of lane j in one chunk, 2^(e-24) beside it (absorbed: a tie, to even), -2^e at the odd k of
    lane j in a later chunk. In the defined order (chunks in order, the odd k first) the lane ends at 0; with the
    chunks in another order it ends at 2^(e-24). Every row count: passes of one and of two weight rows."""
    if not has_path(built, "avx512_bf16"):
        return  # the fp32 paths' order is checked in test_gemm
    gen = torch.Generator().manual_seed(9)
    k, rows = 128, 30
    x = torch.zeros(rows, k)
    for r in range(rows):
        lane = int(torch.randint(0, 16, (1,), generator=gen))
        c1, c2 = sorted(torch.randperm(k // 32, generator=gen)[:2].tolist())
        e = int(torch.randint(24, 28, (1,), generator=gen))
        set_order_trap(x[r], 32 * c1 + 2 * lane, 32 * c2 + 2 * lane, e)
    x = x.to(torch.bfloat16)
    weight = torch.ones(37, k, dtype=torch.bfloat16)
    want = emulated_bf16_rows(x, weight).to(torch.bfloat16)
    assert bool((want == 0).all())  # the defined order cancels exactly
    backwards = emulated_bf16_rows(x.reshape(rows, k // 32, 32).flip(1).reshape(rows, k), weight)
    assert bool((backwards != 0).all())  # and the chunks backwards do not
    try:
        kernels.select_isa("avx512_bf16")
        for passes in (0, 30):
            kernels.set_one_row_passes(passes)
            for m in (1, 2, 3, 4, 5, 9, 10, 30):
                for r0 in range(0, rows, m):
                    got = kernels.linear(x[r0:r0 + m], weight)
                    assert torch.equal(got.view(torch.int16), want[r0:r0 + m].view(torch.int16)), (passes, m, r0)
    finally:
        kernels.select_isa(None)
        kernels.set_one_row_passes(None)


def test_the_amx_path_keeps_rows_independent_and_differs_only_where_it_says(built):
    """amx_bf16: int4 with bf16 activations on AMX tiles for groups of a multiple of 32, in every row count (a
    row's bits never depend on how many rows share its tiles, where in them it sits, nor on threads); close to
    the avx512_bf16 path's definition (TDPBF16PS rounds inside an instruction its own way, and the codes are
    offset by 128); groups of 16 and float32 activations keep the other paths' bits. Without AMX, asking for
    it gives the best path there is."""
    if not has_path(built, "amx_bf16"):
        blocks = random_int4(32, 64, 32, True, seed=6)[0]
        x = torch.randn(3, 64).to(torch.bfloat16)
        try:
            assert kernels.select_isa("amx_bf16") == built.host_isa
            got = kernels.int4_linear(x, blocks)
            kernels.select_isa(built.host_isa)
            assert torch.equal(got, kernels.int4_linear(x, blocks))
        finally:
            kernels.select_isa(None)
        return
    gen = torch.Generator().manual_seed(21)
    try:
        for n, k, group, zero_point in ((72, 256, 64, True), (48, 128, 32, False), (1040, 640, 128, True),
                                        (40, 96, 32, True)):
            blocks = random_int4(n, k, group, zero_point, seed=n)[0]
            x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
            kernels.select_isa("amx_bf16")
            out = kernels.int4_linear(x, blocks)
            for m in (1, 2, 3, 9, 15, 16, 17, 31, 32, 33, 47, 64):
                assert torch.equal(kernels.int4_linear(x[:m], blocks), out[:m]), (n, m)
            for rows in ((5, 9), (16, 40), (33, 70)):  # a row in another place of its tiles
                assert torch.equal(kernels.int4_linear(x[rows[0]:rows[1]], blocks), out[rows[0]:rows[1]]), rows
            with torch_threads(1):
                assert torch.equal(kernels.int4_linear(x, blocks), out)
            # the bf16 result's rounding, and the offset codes' cancellation: t ~ 128 sum|x| to ~4 fewer bits
            want = emulated_bf16_path(x, blocks)
            err = (out.float() - want).abs()
            assert bool((err <= want.abs() * 2.0**-8 + want.abs().max() * 2.0**-12).all()), (n, float(err.max()))
            assert float((out.float() == want.to(torch.bfloat16).float()).float().mean()) > 0.95, n
            xf = x.float()
            fp32 = kernels.int4_linear(xf, blocks)
            kernels.select_isa("scalar")
            assert torch.equal(kernels.int4_linear(xf, blocks), fp32)
        blocks = random_int4(48, 64, 16, True, seed=3)[0]  # groups of 16: the avx512_bf16 path's bits
        x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
        kernels.select_isa("amx_bf16")
        got = kernels.int4_linear(x, blocks)
        kernels.select_isa("avx512_bf16")
        assert torch.equal(got, kernels.int4_linear(x, blocks))
    finally:
        kernels.select_isa(None)


def test_the_row_major_bf16_trees_add_the_lanes_in_the_defined_pairs(built):
    """A bf16 output hides most fp32 rounding, so random inputs cannot tell one tree from another: here each row
    puts 2^30 and -2^30 in two lanes and 1 in a third, so the 1 survives or not by which lanes the tree adds
    first. Every row count (passes of one and of two weight rows) must give the definition's."""
    if not has_path(built, "avx512_bf16"):
        return  # the fp32 paths' order is checked in test_gemm
    gen = torch.Generator().manual_seed(5)
    k, rows = 64, 48
    x = torch.zeros(rows, k)
    for r in range(rows):
        lanes = torch.randperm(16, generator=gen)[:3]
        chunks = torch.randint(0, k // 32, (3,), generator=gen)
        halves = torch.randint(0, 2, (3,), generator=gen)
        for value, lane, chunk, half in zip((2.0**30, -(2.0**30), 1.0), lanes, chunks, halves):
            x[r, 32 * chunk + 2 * lane + half] += value
    x = x.to(torch.bfloat16)
    weight = torch.ones(37, k, dtype=torch.bfloat16)
    weight[1::2] = -1.0
    want = emulated_bf16_rows(x, weight).to(torch.bfloat16)
    assert bool((want.float().abs() < 2.0).all()) and float((want == 0).float().mean()) > 0.1  # both outcomes occur
    assert float((want.float().abs() == 1).float().mean()) > 0.1
    try:
        kernels.select_isa("avx512_bf16")
        for passes in (0, 48):
            kernels.set_one_row_passes(passes)
            for m in (1, 3, 4, 9, 16, 48):
                for r0 in range(0, rows, m):
                    assert torch.equal(kernels.linear(x[r0:r0 + m], weight), want[r0:r0 + m]), (passes, m, r0)
    finally:
        kernels.select_isa(None)
        kernels.set_one_row_passes(None)
