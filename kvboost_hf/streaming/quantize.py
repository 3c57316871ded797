"""Int4 weight quantization for ``awq-pack``: round-to-nearest and AWQ's activation-aware scales.

AWQ (Lin et al., MLSys 2024): channels with large activations matter most, so scale weight
input channels up by ``s = mean|x|^alpha`` before quantizing and divide the preceding operation
by ``s`` (an RMSNorm weight, or the rows of ``up_proj`` for ``down_proj``), which leaves the
float function unchanged. ``alpha`` is searched on calibration activations to minimise the
output error of the quantized linears; ``alpha = 0`` is plain round-to-nearest, so the search
never does worse than RTN on the calibration data. Clipping search is not implemented.
"""

from __future__ import annotations

import torch

from kvboost_hf.streaming.awq_format import dequantize


def rtn_quantize(weight: torch.Tensor, group_size: int, zero_point: bool = True, scale_dtype=torch.float16):
    """Weight ``[N, K]`` -> ``(codes [N, K] int32, zeros [K/G, N], scales [K/G, N])`` (float32 values).

    Scales are rounded to ``scale_dtype`` before use, so the file's scales are the ones the
    codes were computed with.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if zero_point:
        hi, lo = w.amax(-1), w.amin(-1)
        scales = ((hi - lo).clamp(min=1e-5) / 15).to(scale_dtype).to(torch.float32)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    else:
        scales = (w.abs().amax(-1).clamp(min=1e-5) / 7).to(scale_dtype).to(torch.float32)
        zeros = torch.full_like(scales, 8.0)
    codes = torch.clamp(torch.round(w / scales.unsqueeze(-1)) + zeros.unsqueeze(-1), 0, 15)
    return codes.reshape(n, k).to(torch.int32), zeros.t().contiguous(), scales.t().contiguous()


def fake_quantize(weight: torch.Tensor, group_size: int, zero_point: bool = True, scale_dtype=torch.float16):
    """Quantize then dequantize ``weight`` ``[N, K]`` (float32 result)."""
    codes, zeros, scales = rtn_quantize(weight, group_size, zero_point, scale_dtype)
    return dequantize(codes, zeros, scales, group_size)


@torch.no_grad()
def search_scales(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    group_size: int,
    zero_point: bool = True,
    grid: int = 20,
    scale_dtype=torch.float16,
) -> tuple[torch.Tensor, float]:
    """Per-input-channel scales ``[K]`` for linears sharing input ``x`` ``[T, K]``; also the best alpha."""
    x = x.to(torch.float32)
    ws = [w.detach().to(torch.float32) for w in weights]
    reference = [x @ w.t() for w in ws]
    x_mean = x.abs().mean(0)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = 0.0
        for w, ref in zip(ws, reference):
            q = fake_quantize(w * s, group_size, zero_point, scale_dtype) / s
            loss += float(((x @ q.t()) - ref).pow(2).mean())
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]
