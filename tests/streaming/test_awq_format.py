"""AutoAWQ GEMM layout: nibble order, packing round trip, torch int4 mapping, zero_point false."""

from __future__ import annotations

import torch

from kvboost_hf.streaming.awq_format import (
    awq_to_codes,
    dequantize,
    pack_awq,
    scales_and_zeros,
    to_int4pack,
    unpack_awq,
)
from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.quantize import rtn_quantize


def test_unpack_matches_hand_built_autoawq_word():
    # AutoAWQ's packer: for i in range(8): word |= code[col 8c + order_map[i]] << (4 * i),
    # with order_map = [0, 2, 4, 6, 1, 3, 5, 7]. Columns 0..7 hold codes 1..8 here.
    codes = [1, 2, 3, 4, 5, 6, 7, 8]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    word = 0
    for i in range(8):
        word |= codes[order_map[i]] << (4 * i)
    assert word == 0x86427531
    packed = torch.tensor([[word - 2**32]], dtype=torch.int32)  # bit 31 set: negative int32
    assert unpack_awq(packed).tolist() == [codes]
    assert torch.equal(pack_awq(torch.tensor([codes])), packed)


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (12, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    assert torch.equal(unpack_awq(pack_awq(codes)), codes)


def _module(codes, zeros, scales, group_size):
    n, k = codes.shape
    module = AWQInt4Linear(k, n, group_size)
    module.set_weight(to_int4pack(codes, torch.device("cpu")), scales_and_zeros(scales, zeros))
    return module


def _check_against_dequantized(zero_point: bool):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 128, generator=g) * 0.05
    codes, zeros, scales = rtn_quantize(weight, 32, zero_point=zero_point)
    if not zero_point:
        assert torch.all(zeros == 8)
    qweight = pack_awq(codes.t().contiguous())
    qzeros = pack_awq(zeros.to(torch.int32)) if zero_point else None
    c2, z2, s2 = awq_to_codes(qweight, qzeros, scales.to(torch.float16), 32)
    assert torch.equal(c2, codes) and torch.equal(z2, zeros)
    module = _module(c2, z2, s2, 32)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    ref = x.float() @ dequantize(codes, zeros, scales, 32).t()
    out = module(x).float()
    # bf16 activations, bf16 scale/zero and bf16 output: close, not equal.
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max(), (out - ref).abs().max()
    return module


def test_int4_kernel_matches_awq_dequantisation():
    _check_against_dequantized(zero_point=True)


def test_zero_point_false():
    _check_against_dequantized(zero_point=False)


def test_fp32_input_gives_fp32_output_and_bias():
    module = _check_against_dequantized(zero_point=True)
    x = torch.randn(2, 3, 128)
    assert module(x).dtype == torch.float32 and module(x).shape == (2, 3, 64)


def test_int4_kernel_rows_are_independent():
    """Chunk reuse exactness relies on it: a row's result does not depend on the other rows."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.int32)
    module = _module(codes, torch.full((4, 64), 7.0), torch.rand(4, 64, generator=g) * 0.1, 32)
    x = torch.randn(37, 128, generator=g).to(torch.bfloat16)
    whole = module(x)
    assert torch.equal(torch.cat([module(x[i : i + 5]) for i in range(0, 37, 5)]), whole)
    assert torch.equal(module(x[-1:]), whole[-1:])
