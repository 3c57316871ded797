"""Attention on kvboost_hf's C++ kernel (``torch.ops.kvboost.attention``), for models whose numerics we own.

:class:`KernelAttention` is an :class:`~kvboost_hf.models.attention.OwnedAttention`: given to a model's
layers by :func:`~kvboost_hf.models.attention.own_attention` (int4 models on our GEMMs, self-drafts), it
replaces transformers' SDPA on CPU. It reads bf16 K/V as they are (no float32 copy, no ``repeat_kv``)
and computes each query row alone (``csrc/attention_body.inc``), so a verification of ``k + 1`` rows is
one call per layer whose rows equal ``k + 1`` decode steps bit for bit, a batch row equals the
request alone, and a prompt's K/V do not depend on how it was chunked.

Measured on 2 cores of an AMD EPYC (AVX-512), Gemma-3-270M's heads (4 query heads over 1 KV head,
dim 256), bf16: a decode row over 209 / 512 / 4096 keys takes 16 / 31 / 221 us, against 63 / 129 /
3193 us for float32 SDPA of cast inputs and 181 / 436 / 3823 us for bf16 SDPA; 9 rows over 650 keys
280 us in one call, against 9 decode-exact SDPA calls of ~160 us each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost_hf.kernels import ops
from kvboost_hf.models.attention import FLOAT32_SDPA, OwnedAttention


@dataclass(frozen=True)
class KernelAttention:
    """transformers' SDPA semantics (masks, ``is_causal``, ``scaling``, GQA) on the kvboost kernel."""

    name: str = "kvboost-attention-v1"  # in the store namespace: bump it when the kernel's bits change

    def __post_init__(self) -> None:
        if not self.available():
            raise RuntimeError("KernelAttention needs the kvboost_hf kernels: see kvboost_hf.kernels.available()")

    @staticmethod
    def available() -> bool:
        """Whether the kernels are built and loaded in this process (building them on first call)."""
        return ops.loaded()

    def applies(self, query: torch.Tensor) -> bool:
        return query.device.type == "cpu" and query.dtype in ops.DTYPES

    def __call__(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, position_bias: torch.Tensor | None = None, **kwargs):
        _refuse(dropout, kwargs)
        rows = query.shape[2]
        # As transformers' SDPA forward decides it (a decode row reads every key).
        causal = rows > 1 and attention_mask is None and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if causal and key.shape[2] > rows:  # an empty static cache's prefill: its first `rows` slots
            key, value = key[:, :, :rows], value[:, :, :rows]
            position_bias = None if position_bias is None else position_bias[..., :rows]
        mask = _with_bias(attention_mask, position_bias)
        return ops.attention(query, key, value, mask, scale=scaling, causal=bool(causal)), None

    def decode_rows(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    window: int | None, scaling: float | None, dropout: float = 0.0,
                    position_bias: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """One call: row ``i`` reads the keys up to its position (the last ``window`` of them on a sliding
        layer), exactly the keys its decode step reads, and is computed as that step computes it. None with
        a position bias (then each row is a call of its own, with its bias)."""
        _refuse(dropout, kwargs)
        if position_bias is not None:
            return None
        return ops.attention(query, key, value, None, scale=scaling, causal=True, window=window)


def _refuse(dropout: float, kwargs: dict) -> None:
    """Errors for what transformers' SDPA refuses too, or what an inference kernel cannot do."""
    if kwargs.get("softcap") is not None:
        raise ValueError("kvboost attention, like `sdpa`, does not support `softcap`: use `eager` attention")
    if dropout:
        raise ValueError(f"kvboost attention is for inference: dropout must be 0, got {dropout} (call model.eval())")
    if kwargs.get("cache") is not None:
        raise NotImplementedError("kvboost attention does not run on transformers' paged cache "
                                  "(continuous batching): use kvboost_hf's server batching instead")


def _with_bias(mask: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A T5-style position bias folded into the mask (float, added to the scores; -inf where masked)."""
    if bias is None:
        return mask
    bias = bias.float()
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask.float()


def cpu_attention(dtype: torch.dtype) -> OwnedAttention | None:
    """The attention a CPU model whose numerics kvboost_hf owns should compute in ``dtype``: the kernel
    where it is built; else float32 SDPA for reduced precision (bf16 SDPA is slow for a decode row);
    else None (float32 SDPA is SDPA)."""
    if KernelAttention.available():
        return KernelAttention()
    return FLOAT32_SDPA if dtype != torch.float32 else None
