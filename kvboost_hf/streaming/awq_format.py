"""The AutoAWQ GEMM tensor layout and its conversion to torch's int4 kernel layout.

AutoAWQ GEMM stores, per linear with ``in_features = K``, ``out_features = N`` and group size ``G``:

- ``qweight`` int32 ``[K, N/8]``: nibble ``i`` (bits ``4i..4i+3``) of word ``c`` holds the code of
  output column ``8c + AWQ_ORDER[i]``;
- ``qzeros`` int32 ``[K/G, N/8]``, packed the same way (all 8 when ``zero_point`` is false);
- ``scales`` ``[K/G, N]`` in fp16 or bf16.

Dequantised weight: ``w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.

torch's CPU kernel computes ``(q - 8) * scale + zero`` per group, so AWQ maps to
``scale = s`` and ``zero = (8 - z) * s``, packed as ``[K/G, N, 2]`` bf16.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset held by nibble i
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble holding column offset j


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C/8]`` AutoAWQ words -> int32 codes ``[R, C]`` (0..15) in column order."""
    if packed.dtype != torch.int32:
        raise ValueError(f"AutoAWQ packed tensors are int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8], nibble i last
    columns = nibbles[..., list(AWQ_REVERSE_ORDER)]  # column offset j last
    return columns.reshape(packed.shape[0], -1).contiguous()


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """int codes ``[R, C]`` (0..15) -> AutoAWQ int32 words ``[R, C/8]``."""
    rows, cols = codes.shape
    if cols % 8:
        raise ValueError(f"AutoAWQ packing needs a column count divisible by 8, got {cols}")
    grouped = codes.to(torch.int64).reshape(rows, cols // 8, 8)[..., list(AWQ_ORDER)]  # nibble i last
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (grouped << shifts).sum(-1)
    # Two's complement into int32 (bit 31 may be set).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).contiguous()


def awq_to_codes(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int):
    """AutoAWQ tensors -> ``(codes [N, K] int32, zeros [K/G, N] float32, scales [K/G, N] float32)``."""
    codes = unpack_awq(qweight).t().contiguous()
    in_features, out_features = qweight.shape[0], codes.shape[0]
    groups = in_features // group_size
    if tuple(scales.shape) != (groups, out_features):
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected {(groups, out_features)} for group_size {group_size}"
        )
    if qzeros is None:
        zeros = torch.full((groups, out_features), 8.0)
    else:
        zeros = unpack_awq(qzeros).to(torch.float32)
    return codes, zeros, scales.to(torch.float32)


def scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """AWQ ``s``, ``z`` ``[K/G, N]`` -> torch's ``[K/G, N, 2]`` bf16 (scale, (8 - z) * s)."""
    return torch.stack([scales, (8.0 - zeros) * scales], dim=-1).to(torch.bfloat16).contiguous()


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 weight ``[N, K]`` from codes ``[N, K]`` and per-group ``zeros``/``scales`` ``[K/G, N]``."""
    z = zeros.t().repeat_interleave(group_size, dim=1)
    s = scales.t().repeat_interleave(group_size, dim=1)
    return (codes.to(torch.float32) - z) * s


def to_int4pack(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Codes ``[N, K]`` -> torch's packed int4 weight for ``device`` (converted once, at load)."""
    if device.type == "cuda":  # not in CI (no GPU): benchmarks/cuda_check.py checks it on one
        # torch's own tests pack even columns into the high nibble for the CUDA op.
        uint8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(uint8, k_tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a packed int4 weight; ``x`` is 2-D bf16 on the weight's device."""
    if packed.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)
