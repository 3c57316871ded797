"""``KernelRMSNorm``: a :class:`~kvboost_hf.models.fused_norm.FusedRMSNorm` computed by kvboost_hf's C++ op.

On CPU, ``torch.rms_norm`` runs as six small ATen ops (pow, mean, add, rsqrt and two muls), about 25 us
for one row of Gemma-3-270M (109 of them per decode step, with the casts around them); the op
``torch.ops.kvboost.rms_norm`` is one call over the row. Its bits are its own (``csrc/norm_body.inc``:
the sum of squares in the kernels' dot-product order), the same for every ISA path, row count and
thread count, so rows stay independent. Given to the norms of models whose numerics we own
(``fuse_norms(..., norm=KernelRMSNorm)``); off CPU it computes as :class:`FusedRMSNorm` does.
"""

from __future__ import annotations

import torch

from kvboost_hf.kernels import ops
from kvboost_hf.models.fused_norm import FusedRMSNorm


class KernelRMSNorm(FusedRMSNorm):
    """``x * rsqrt(mean(x^2) + eps) * scale`` on the kvboost op (CPU), in ``x``'s dtype."""

    kvboost_numerics = "kvboost-rms-norm-v1"  # in the store namespace (models.fingerprint)

    def __init__(self, scale: torch.Tensor, eps: float) -> None:
        if not ops.loaded():
            raise RuntimeError("KernelRMSNorm needs the kvboost_hf kernels: see kvboost_hf.kernels.available()")
        super().__init__(scale, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in ops.DTYPES:  # float64, or a model moved to a GPU
            return super().forward(x)
        return ops.rms_norm(x, self.scale, self.eps)


def cpu_norm() -> type[FusedRMSNorm]:
    """The fused RMSNorm for a CPU model whose numerics kvboost_hf owns: the kernel's where it is built."""
    return KernelRMSNorm if ops.loaded() else FusedRMSNorm
