"""The kernels' weight layouts (``csrc/kvboost_kernels.h``), built once at load time with torch ops.

Output columns go in blocks of 16 (the last block padded with zero weights); each block holds its
``K`` rows contiguously, so one pass over a block streams its weights once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/16), K, 16]`` (padded rows are zero)."""
    n, k = t.shape
    pad = -n % BLOCK
    if pad:
        t = torch.cat([t, t.new_zeros(pad, k)])
    return t.reshape(-1, BLOCK, k).transpose(1, 2).contiguous()


def _group_blocks(t: torch.Tensor, fill: float) -> torch.Tensor:
    """Per-group ``[K/G, N]`` -> ``[ceil(N/16), K/G, 16]`` float32 (padded columns get ``fill``)."""
    groups, n = t.shape
    pad = -n % BLOCK
    t = t.to(torch.float32)
    if pad:
        t = torch.cat([t, t.new_full((groups, pad), fill)], dim=1)
    return t.reshape(groups, -1, BLOCK).transpose(0, 1).contiguous()


@dataclass
class Int4Blocks:
    """An int4 weight in the kernel's layout: ``w[n, k] = (q - zeros) * scales`` per group of ``group_size``."""

    qweight: torch.Tensor  # uint8 [NB, K, 8]
    scales: torch.Tensor  # float32 [NB, K/G, 16]
    zeros: torch.Tensor  # float32 [NB, K/G, 16]
    group_size: int
    out_features: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}


def int4_qweight(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` (0..15, K even) -> uint8 ``[NB, K, 8]``: per block, the 16 bytes of rows 2p and
    2p+1 hold in byte j column j of row 2p (low nibble) and of row 2p+1 (high nibble)."""
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("int4 codes must lie in 0..15")
    if codes.shape[1] % 2:
        raise ValueError(f"int4 in_features must be even, got {codes.shape[1]}")
    c = _blocks(codes.to(torch.uint8))  # [NB, K, 16]
    nb, k = c.shape[:2]
    pairs = c.reshape(nb, k // 2, 2, BLOCK)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, k, 8).contiguous()


def int4_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zeros ``[K/G, N]`` -> float32 ``[NB, K/G, 16]``."""
    return _group_blocks(t, 0.0)


def pack_int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Blocks:
    """Codes ``[N, K]`` (0..15) with per-group ``zeros``/``scales`` ``[K/G, N]`` -> :class:`Int4Blocks`."""
    n, k = codes.shape
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"group_size must be even and divide in_features {k}, got {group_size}")
    if tuple(scales.shape) != (k // group_size, n) or tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"scales/zeros must be [{k // group_size}, {n}], got {tuple(scales.shape)} and "
                         f"{tuple(zeros.shape)}")
    return Int4Blocks(int4_qweight(codes), int4_groups(scales), int4_groups(zeros), group_size, n)


@dataclass
class Int8Blocks:
    """An int8 weight in the kernel's layout: ``out[:, n] = (x @ q[n]) * scales[n]``."""

    qweight: torch.Tensor  # int8 [NB, K, 16]
    scales: torch.Tensor  # float32 [NB * 16]
    out_features: int


def pack_int8(q: torch.Tensor, scales: torch.Tensor) -> Int8Blocks:
    """int8 ``[N, K]`` with one scale per output row ``[N]`` -> :class:`Int8Blocks`."""
    n = q.shape[0]
    if q.dtype != torch.int8 or tuple(scales.shape) != (n,):
        raise ValueError(f"need int8 [N, K] and scales [N], got {q.dtype} {tuple(q.shape)} and {tuple(scales.shape)}")
    s = scales.to(torch.float32)
    pad = -n % BLOCK
    if pad:
        s = torch.cat([s, s.new_zeros(pad)])
    return Int8Blocks(_blocks(q), s.contiguous(), n)


@dataclass
class DenseBlocks:
    """A bf16 or float32 weight ``[N, K]`` in the kernel's layout."""

    weight: torch.Tensor  # bf16 / float32 [NB, K, 16]
    out_features: int


def pack_dense(weight: torch.Tensor) -> DenseBlocks:
    """A ``[N, K]`` bf16/float32 weight (other float dtypes are kept as float32) -> :class:`DenseBlocks`."""
    w = weight.detach()
    if w.dtype not in (torch.bfloat16, torch.float32):
        w = w.to(torch.float32)
    return DenseBlocks(_blocks(w), weight.shape[0])


def unpack_int4(blocks: Int4Blocks) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that :class:`Int4Blocks` stands for (the tests' reference)."""
    q = blocks.qweight
    nb, k = q.shape[:2]
    pairs = q.reshape(nb, k // 2, 1, BLOCK)
    codes = torch.cat([pairs & 0xF, pairs >> 4], dim=2).reshape(nb, k, BLOCK).to(torch.float32)
    g = blocks.group_size
    s = blocks.scales.repeat_interleave(g, dim=1)
    z = blocks.zeros.repeat_interleave(g, dim=1)
    w = ((codes - z) * s).transpose(1, 2).reshape(-1, q.shape[1])
    return w[: blocks.out_features]
