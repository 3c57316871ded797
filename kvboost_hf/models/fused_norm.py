"""``FusedRMSNorm``: one fused ``torch.rms_norm`` call in place of a model's RMSNorm module, for models
whose numerics kvboost_hf owns (self-drafts, int4 models on kvboost_hf's kernels).

A decode step of a small model has one row, where per-op dispatch, not arithmetic, is most of the
time. HF's RMSNorm modules take 6-8 small ops each (Gemma-3-270M runs 109 of
them per token: ~20 us each on this project's CPUs, against ~8 us for one ``torch.rms_norm``).

The replacement is derived from the module's behaviour, not from its class: its per-channel scale is
read off its output for a constant input (Gemma's ``1 + w``, Llama's ``w``), and the swap is kept only
if it matches the module on random inputs to within bf16 rounding. It rounds differently in the last
bits (Llama multiplies after casting to the input dtype, this multiplies before), which a draft or an
int4 model on our kernels may, and a stock model must not (its promise is identity with plain HF
``generate``): stock models keep their own modules. It is computed row by row, so rows stay
independent (a verification forward's rows equal decoding them; torch's CPU reduction splits a
single row across threads only from 32768 elements, wider than any model's hidden size).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

TOLERANCE = 2e-2  # relative to the element plus its row's RMS: bf16 has 8 significant bits


class FusedRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * scale`` over the last dimension, computed in float32."""

    kvboost_numerics = "torch-rms-norm"  # in the store namespace: a subclass computing other bits names itself

    def __init__(self, scale: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().to(torch.float32).contiguous())
        self.eps = float(eps)
        self.shape = (scale.shape[0],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rms_norm(x.float(), self.shape, self.scale.float(), self.eps).to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        """``model.to(dtype)`` moves the scale but keeps it float32 (Gemma's ``1 + w`` in bf16 would be
        off by up to 2^-8 relative on every channel)."""
        scale = self.scale
        super()._apply(fn, recurse)
        if self.scale.dtype != torch.float32:
            self.scale = scale.to(device=self.scale.device)
        return self

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}"


@torch.no_grad()
def fused_equivalent(module: nn.Module, dtype: torch.dtype, norm: type[FusedRMSNorm] = FusedRMSNorm
                     ) -> FusedRMSNorm | None:
    """A ``norm`` (:class:`FusedRMSNorm` or a subclass) that behaves like ``module`` on ``dtype`` inputs, or None."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if not type(module).__name__.endswith("RMSNorm") or weight is None or weight.dim() != 1 or eps is None:
        return None
    if weight.device.type == "meta":  # offloaded or not loaded: nothing to read the scale from
        return None
    dim = weight.shape[0]
    ones = torch.ones(1, dim, dtype=torch.float32, device=weight.device)
    scale = module(ones).float()[0] * torch.sqrt(torch.tensor(1.0 + float(eps)))
    fused = norm(scale, float(eps))
    x = probe_inputs(dim).to(device=weight.device, dtype=dtype)
    expected, got = module(x), fused(x)
    if got.shape != expected.shape or got.dtype != expected.dtype:  # e.g. a float32 weight promoting its output
        return None
    expected, got = expected.float(), got.float()
    row_rms = expected.pow(2).mean(-1, keepdim=True).sqrt()
    if not bool(((got - expected).abs() <= TOLERANCE * (expected.abs() + row_rms)).all()):
        logger.debug("kept %s: a fused rms_norm does not reproduce it", type(module).__name__)
        return None
    return fused


def probe_inputs(dim: int) -> torch.Tensor:
    """Rows a norm over the whole last dimension treats alike and variants of it do not: Gaussian rows,
    rows with one dominant channel (a norm over groups of channels differs there), rows whose halves
    have very different scales, and a row of small values (where ``eps`` matters)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    gaussian = torch.randn(8, dim, generator=generator) * 3
    spiked = torch.randn(4, dim, generator=generator)
    spiked[torch.arange(4), torch.randint(0, dim, (4,), generator=generator)] = 60.0
    halves = torch.randn(2, dim, generator=generator)
    halves[:, : dim // 2] *= 10.0
    halves[:, dim // 2 :] *= 0.1
    small = torch.randn(1, dim, generator=generator) * 1e-3
    return torch.cat([gaussian, spiked, halves, small])


def fuse_norms(root: nn.Module, dtype: torch.dtype, norm: type[FusedRMSNorm] = FusedRMSNorm) -> int:
    """Replace every RMSNorm module under ``root`` that :func:`fused_equivalent` reproduces with a ``norm``
    (kvboost_hf's op where the kernels are built: ``kernels.norm.KernelRMSNorm``); returns how many."""
    replaced = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            fused = fused_equivalent(child, dtype, norm)
            if fused is not None:
                setattr(parent, name, fused)
                replaced += 1
    return replaced
