"""KIVI-style K/V quantization at rest: keys per channel, values per token, int8 or packed int4.

Keys have outlier *channels*, so each (head, channel) gets its own scale and zero point over
the tokens of a chunk. Values have no channel outliers but vary per token, so each token gets a
scale and zero point per group of ``group_size`` channels (Liu et al., KIVI, 2024). Scales and
zero points are float16. int4 codes are packed two per byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (8, 4)


@dataclass
class QuantizedTensor:
    """Asymmetric integer codes of a ``[heads, tokens, head_dim]`` tensor: ``x ~ codes * scale + zero``."""

    codes: torch.Tensor  # uint8; int4 codes packed two per byte
    scale: torch.Tensor  # float16, broadcastable against the grouped tensor
    zero: torch.Tensor  # float16, same shape as scale
    bits: int
    shape: tuple[int, ...]  # shape of the grouped (pre-flattening) tensor
    out_shape: tuple[int, ...]  # ``[heads, tokens, head_dim]``
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    @property
    def num_tokens(self) -> int:
        return self.out_shape[1]

    def dequantize(self) -> torch.Tensor:
        codes = _unpack4(self.codes, _numel(self.shape)) if self.bits == 4 else self.codes
        codes = codes.reshape(self.shape).to(torch.float32)
        x = codes * self.scale.to(torch.float32) + self.zero.to(torch.float32)
        return x.reshape(self.out_shape).to(self.dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def _unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)
    return out[:numel]


def _quantize(grouped: torch.Tensor, reduce_dim: int, bits: int, out_shape, dtype) -> QuantizedTensor:
    x = grouped.to(torch.float32)
    lo = x.amin(dim=reduce_dim, keepdim=True)
    hi = x.amax(dim=reduce_dim, keepdim=True)
    levels = (1 << bits) - 1
    # Round the affine parameters to their stored precision first, so codes are chosen for them.
    scale = ((hi - lo) / levels).clamp_min(1e-8).to(torch.float16).to(torch.float32).clamp_min(6e-8)
    zero = lo.to(torch.float16).to(torch.float32)
    codes = torch.round((x - zero) / scale).clamp_(0, levels).to(torch.uint8)
    packed = _pack4(codes) if bits == 4 else codes
    return QuantizedTensor(
        packed, scale.to(torch.float16), zero.to(torch.float16), bits, tuple(grouped.shape), tuple(out_shape), dtype
    )


def quantize_keys(keys: torch.Tensor, bits: int) -> QuantizedTensor:
    """Per-channel quantization of ``[heads, tokens, head_dim]`` keys over the token axis."""
    check_bits(bits)
    return _quantize(keys, reduce_dim=1, bits=bits, out_shape=keys.shape, dtype=keys.dtype)


def quantize_values(values: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
    """Per-token quantization of ``[heads, tokens, head_dim]`` values in channel groups of ``group_size``."""
    check_bits(bits)
    heads, tokens, head_dim = values.shape
    if head_dim % group_size:
        raise ValueError(f"group_size={group_size} does not divide head_dim={head_dim}")
    grouped = values.reshape(heads, tokens, head_dim // group_size, group_size)
    return _quantize(grouped, reduce_dim=-1, bits=bits, out_shape=values.shape, dtype=values.dtype)


def default_group_size(head_dim: int) -> int:
    """The largest of 128, 64, 32, 16, 8 dividing ``head_dim`` (``head_dim`` itself otherwise)."""
    return next((g for g in (128, 64, 32, 16, 8) if head_dim % g == 0), head_dim)


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kv_bits must be None, 8 or 4, got {bits!r}")
