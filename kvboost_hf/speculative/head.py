"""``DraftHead``: a self-draft's LM head, quantized, optionally restricted to a token subset (FR-Spec)."""

from __future__ import annotations

import torch
from torch import nn

from kvboost_hf.speculative.quantized import quantized_linear


class DraftHead(nn.Module):
    """Logits over the full vocabulary from a quantized head over ``tokens`` (all when None).

    Tokens outside the subset get ``-inf``: they are never drafted, and their draft probability is
    exactly 0 in HF's speculative sampling. ``softcap`` applies Gemma-style logit soft-capping to the
    computed logits (the draft's config then leaves it off, so ``-inf`` stays ``-inf``).
    """

    def __init__(self, linear: nn.Module, vocab_size: int, tokens: torch.Tensor | None,
                 softcap: float | None) -> None:
        super().__init__()
        self.linear, self.vocab_size, self.softcap = linear, vocab_size, softcap
        self.register_buffer("tokens", tokens, persistent=False)

    @classmethod
    @torch.no_grad()
    def build(cls, head: nn.Module, bits: int, vocab_size: int, tokens: torch.Tensor | None,
              softcap: float | None) -> DraftHead:
        if not isinstance(head, nn.Linear):
            raise TypeError(f"make_draft needs an nn.Linear output head, got {type(head).__name__}")
        weight, bias = head.weight, head.bias
        if tokens is not None:
            tokens = tokens.to(weight.device)
            weight = weight[tokens]
            bias = None if bias is None else bias[tokens]
        return cls(quantized_linear(weight, bias, bits), vocab_size, tokens, softcap)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden).float()  # a bfloat16 draft still gives float32 logits
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.tokens is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.tokens] = logits
        return full
