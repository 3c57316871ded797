"""``KernelLinear``: an ``nn.Linear`` whose forward runs :func:`kvboost_hf.kernels.linear`.

Used for the output head of models whose other linears run on these kernels: the head keeps its
weight tensor (a tied embedding stays tied, no copy) and its rows become bit-independent too.
"""

from __future__ import annotations

import torch
from torch import nn

from kvboost_hf.kernels.ops import linear


class KernelLinear(nn.Linear):
    """``nn.Linear`` on this package's CPU kernel; the weight stays bf16/float32 ``[out, in]``."""

    @classmethod
    def adopt(cls, module: nn.Linear) -> KernelLinear:
        """``module`` as a :class:`KernelLinear` sharing its parameters (a plain ``nn.Linear`` only)."""
        if type(module) is not nn.Linear:
            raise TypeError(f"KernelLinear adopts a plain nn.Linear, got {type(module).__name__}")
        adopted = cls.__new__(cls)
        adopted.__dict__ = module.__dict__  # the same parameters, hooks and flags: tying is kept
        return adopted

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Whether ``module`` is a plain CPU ``nn.Linear`` this kernel takes (bf16/float32, in_features % 16 == 0)."""
        return (type(module) is nn.Linear and module.weight.device.type == "cpu" and module.in_features % 16 == 0
                and module.weight.dtype in (torch.bfloat16, torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
