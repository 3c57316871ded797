"""Which int4 GEMM an AWQ linear computes with: torch's packed int4 op, or kvboost_hf's own kernels
(:mod:`kvboost_hf.kernels`: each weight decoded once per call for all rows, rows bit-independent).

A kernel owns its weight layout: :meth:`Int4Kernel.pack` makes the big tensor (resident, or the
bytes a layer streamer stages) and :meth:`Int4Kernel.side` the small per-group tensor that stays
resident; :meth:`Int4Kernel.matmul` takes both.
"""

from __future__ import annotations

import torch

from kvboost_hf import kernels
from kvboost_hf.streaming.awq_format import int4_matmul, scales_and_zeros, to_int4pack
from kvboost_hf.streaming.config import KERNEL_CHOICES


class Int4Kernel:
    """``x @ W.T`` for ``W = (q - z) * s`` per group, in the layout this kernel packs."""

    name = ""
    amortises_rows = False  # whether a call's cost grows slower than its row count

    @property
    def numerics(self) -> str | None:
        """A name for the bits this kernel computes, where they are not the model's usual ones (the store
        namespace takes it: K/V computed one way never serve a model computing another way); None: torch's."""
        return None

    def pack(self, codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def side(self, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x2: torch.Tensor, packed: torch.Tensor, side: torch.Tensor, group_size: int,
               out_features: int) -> torch.Tensor:
        raise NotImplementedError


class TorchInt4(Int4Kernel):
    """torch's ``_weight_int4pack_mm`` (``_for_cpu`` on CPU): bf16 activations, about one weight decode per row."""

    name = "torch"

    def pack(self, codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        return to_int4pack(codes, device)

    def side(self, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        return scales_and_zeros(scales, zeros)

    def matmul(self, x2, packed, side, group_size, out_features):
        return int4_matmul(x2.to(torch.bfloat16).contiguous(), packed, group_size, side)


class KvboostInt4(Int4Kernel):
    """``torch.ops.kvboost.int4_linear`` (CPU): float32 accumulation in a fixed order.

    Activations are rounded to bf16 and the result is bf16, as with torch's op: an AWQ linear's
    contract is bf16 activations whatever the model's dtype (a float32 model's other ops then see
    the same values on either kernel, up to the accumulation's rounding)."""

    name = "kvboost"
    amortises_rows = True

    @property
    def numerics(self) -> str:
        return kernels.int4_numerics()  # the ISA path in effect decides

    def pack(self, codes: torch.Tensor, device: torch.device) -> torch.Tensor:
        return kernels.int4_qweight(codes).to(device)

    def side(self, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        return torch.stack([kernels.int4_groups(scales), kernels.int4_groups(zeros)])  # [2, NB, K/G, 16]

    def matmul(self, x2, packed, side, group_size, out_features):
        return torch.ops.kvboost.int4_linear(x2.to(torch.bfloat16), packed, side[0], side[1], group_size, out_features)


def resolve_int4_kernel(choice: str, device: torch.device) -> Int4Kernel:
    """``"torch"``, ``"kvboost"`` (an error where it cannot run), or ``"auto"`` (kvboost on CPU when built)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "torch":
        return TorchInt4()
    if device.type != "cpu":
        if choice == "kvboost":
            raise ValueError(f"kernel='kvboost' runs on CPU only; this model is on {device} (use 'auto' or 'torch')")
        return TorchInt4()
    status = kernels.available()
    if status.built:
        return KvboostInt4()
    if choice == "kvboost":
        raise RuntimeError(f"kernel='kvboost' but the kvboost_hf kernels are not built: {status.reason}")
    return TorchInt4()
