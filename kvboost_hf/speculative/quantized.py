"""Weight-only int4 / int8 linears for self-drafts.

int4 reuses the AWQ streaming path (:mod:`kvboost_hf.streaming`): round-to-nearest group
quantization and an :class:`~kvboost_hf.streaming.kernel.Int4Kernel` (this package's CPU kernels
when built, else torch's ``_weight_int4pack_mm``). int8 is per-output-channel symmetric, on this
package's kernel (:class:`BlockedInt8Linear`) or ``torch._weight_int8pack_mm``. Both return the
input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kvboost_hf import kernels
from kvboost_hf.streaming.kernel import Int4Kernel, resolve_int4_kernel
from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.quantize import rtn_quantize

GROUP_SIZES = (128, 64, 32)
INT4_ROW_MULTIPLE = 16  # torch's CPU int4 packing needs out_features divisible by 16
DENSE_MIN_ROWS = 128  # from this many rows on, an int4 draft linear dequantizes and runs a dense matmul


class Int8Linear(nn.Module):
    """int8 weight ``[out, in]`` with one bf16 scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().to(torch.float32)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("int8_weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("int8_scales", scales.to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch._weight_int8pack_mm(x2, self.int8_weight, self.int8_scales)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class BlockedInt8Linear(Int8Linear):
    """:class:`Int8Linear` on this package's int8 kernel (float32 accumulation, rows bit-independent)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.blocks = kernels.pack_int8(self.int8_weight, self.int8_scales.to(torch.float32))
        self.int8_weight = self.blocks.qweight  # one copy of the weight, in the kernel's layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.int8_linear(x, self.blocks)
        return out if self.bias is None else out + self.bias


class Int4DraftLinear(AWQInt4Linear):
    """A resident int4 linear that, on torch's kernel, also keeps its codes two per byte for calls with
    many rows.

    torch's CPU int4 kernel costs about the same per row whatever the number of rows, so a draft's
    prompt prefill or catch-up (hundreds of rows) is slow on it. From :data:`DENSE_MIN_ROWS` rows
    on, the weight is dequantized to bf16 for that call and multiplied densely: measured on a
    2048 x 640 projection at 700 rows (AVX512-bf16 CPU), int4 kernel 10.6 ms, dequantize 0.8 ms +
    bf16 matmul 0.7 ms. The codes cost another half byte per weight. Drafts only: the dense path
    rounds differently from the kernel, which a draft may, and a target must not. A kernel that
    decodes each weight once per call (``kernel.amortises_rows``) needs neither.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 kernel: Int4Kernel | None = None) -> None:
        super().__init__(in_features, out_features, group_size, bias, kernel)
        self.register_buffer("int4_nibbles", None)

    def set_codes(self, codes: torch.Tensor) -> None:
        """Keep ``codes`` ``[out, in]`` (0..15) two per byte, even input columns in the low nibble."""
        c = codes.to(torch.uint8)
        self.register_buffer("int4_nibbles", (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous())

    def dense_weight(self) -> torch.Tensor:
        """The bf16 weight ``[out, in]``: ``(q - 8) * scale + zero`` per group, as torch's kernel defines it."""
        n, k, g = self.out_features, self.in_features, self.group_size
        nibbles = self.int4_nibbles
        q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, k // g, g).to(torch.bfloat16)
        scale = self.int4_scales_zeros[..., 0].t().unsqueeze(-1)
        zero = self.int4_scales_zeros[..., 1].t().unsqueeze(-1)
        return ((q - 8) * scale + zero).reshape(n, k)

    def kernel_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As :meth:`AWQInt4Linear.kernel_blocks`, where :meth:`forward` never takes the dense path."""
        return super().kernel_blocks() if self.kernel.amortises_rows or self.int4_nibbles is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows < DENSE_MIN_ROWS or self.int4_nibbles is None or x.device.type != "cpu" or self.kernel.amortises_rows:
            return super().forward(x)
        x2 = x.reshape(rows, self.in_features).to(torch.bfloat16)
        out = (x2 @ self.dense_weight().T).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class PaddedInt4Linear(nn.Module):
    """An :class:`AWQInt4Linear` over rows padded to a multiple of 16, sliced back to ``out_features``."""

    def __init__(self, inner: AWQInt4Linear, out_features: int) -> None:
        super().__init__()
        self.inner, self.out_features = inner, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[..., : self.out_features]


def group_size_for(in_features: int) -> int:
    for group in GROUP_SIZES:
        if in_features % group == 0:
            return group
    raise ValueError(f"int4 needs in_features divisible by one of {GROUP_SIZES}, got {in_features}")


def int4_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, kernel: str = "auto") -> nn.Module:
    """A resident int4 linear computing ``x @ weight.T (+ bias)`` (weight ``[out, in]``) on ``kernel``
    (``"auto"``, ``"kvboost"`` or ``"torch"``, as in :class:`~kvboost_hf.streaming.StreamingAWQConfig`)."""
    out_features, in_features = weight.shape
    group = group_size_for(in_features)
    kernel = resolve_int4_kernel(kernel, weight.device)
    pad = 0 if kernel.amortises_rows else -out_features % INT4_ROW_MULTIPLE  # the blocked layout pads itself
    w = weight.detach().to(torch.float32)
    if pad:
        w = torch.cat([w, w.new_zeros(pad, in_features)])
    codes, zeros, scales = rtn_quantize(w, group, scale_dtype=torch.bfloat16)
    module = Int4DraftLinear(in_features, w.shape[0], group, bias=False, kernel=kernel)
    module.set_weight(kernel.pack(codes, weight.device), kernel.side(scales, zeros).to(weight.device))
    if not kernel.amortises_rows:
        module.set_codes(codes.to(weight.device))
    out: nn.Module = PaddedInt4Linear(module, out_features) if pad else module
    if bias is not None:
        return _WithBias(out, bias)
    return out


class _WithBias(nn.Module):
    def __init__(self, inner: nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias


def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, bits: int, kernel: str = "auto") -> nn.Module:
    """A weight-only ``bits`` (4 or 8) linear of ``weight`` ``[out, in]`` on ``kernel`` (see :func:`int4_linear`)."""
    if bits == 4:
        return int4_linear(weight, bias, kernel)
    if bits == 8:
        blocked = kernel != "torch" and weight.device.type == "cpu" and kernels.available().built
        return BlockedInt8Linear(weight, bias) if blocked else Int8Linear(weight, bias)
    raise ValueError(f"bits must be 4 or 8, got {bits!r}")
