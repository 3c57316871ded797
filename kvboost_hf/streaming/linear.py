"""``AWQInt4Linear``: a linear layer computing with a packed int4 weight, on an :class:`~.kernel.Int4Kernel`.

A resident module holds its packed weight as the buffer ``int4_weight``. A streamed module
holds only ``int4_scales_zeros``, its kernel's per-group tensor (a few percent of the packed
bytes at group size 128); the
layer streamer points ``staged_weight`` at a staging slot while the module's decoder layer
runs. Both buffers take part in ``named_buffers``, so content hashes of the model see them.
"""

from __future__ import annotations

import torch
from torch import nn

from kvboost_hf.streaming.kernel import Int4Kernel, KvboostInt4, TorchInt4


class AWQInt4Linear(nn.Module):
    """int4 weight (AutoAWQ semantics), output in the input's dtype; ``kernel`` packs and multiplies."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 kernel: Int4Kernel | None = None) -> None:
        super().__init__()
        if in_features % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide in_features {in_features} of a quantized linear"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.kernel = kernel or TorchInt4()
        self.streamed = False
        self.group = None  # a fused ProjectionGroup (streaming.fused) this linear's calls go through
        self.staged_weight: torch.Tensor | None = None
        self.register_buffer("int4_weight", None)
        self.register_buffer("int4_scales_zeros", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def set_weight(self, packed: torch.Tensor | None, scales_zeros: torch.Tensor) -> None:
        """Install converted tensors: ``packed=None`` marks the module as streamed (a fused group this
        module belongs to is dissolved: it would compute from the tensors it joined)."""
        if self.group is not None:
            self.group.dissolve()
        self.streamed = packed is None
        if packed is not None:
            self.register_buffer("int4_weight", packed)
        self.register_buffer("int4_scales_zeros", scales_zeros)

    @property
    def kvboost_numerics(self) -> str | None:
        """The bits this linear computes, for the store namespace (``models.fingerprint.module_numerics``)."""
        return self.kernel.numerics

    def packed_weight(self) -> torch.Tensor | None:
        """The packed weight this linear computes with now: its staging slot's while streamed, else its own."""
        return self.staged_weight if self.streamed else self.int4_weight

    def kernel_blocks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(packed, side)``: the weight this linear computes with now, where that is kvboost_hf's int4 kernel
        (for :mod:`kvboost_hf.kernels.layer`, which then computes it as :meth:`forward` does); else None."""
        packed = self.packed_weight()
        return None if packed is None or not isinstance(self.kernel, KvboostInt4) else (packed, self.int4_scales_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight()
        if packed is None:
            raise RuntimeError(
                "streamed AWQ weight used outside its decoder layer's forward (no staging slot holds it)"
            )
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        out = self.group.output(self, x, x2) if self.group is not None else None
        if out is None:
            out = self.kernel.matmul(x2, packed, self.int4_scales_zeros, self.group_size, self.out_features)
        out = out.to(x.dtype).reshape(*shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"bias={self.bias is not None}, streamed={self.streamed}, kernel={self.kernel.name}"
        )
