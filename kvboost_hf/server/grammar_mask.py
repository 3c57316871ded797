"""``GrammarMask``: the logits processor that keeps generation inside a compiled xgrammar grammar."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class GrammarMask(LogitsProcessor):
    """Masks every token the grammar does not allow next (one xgrammar matcher per batch row).

    Like xgrammar's own ``contrib.hf.LogitsProcessor``, plus: a row whose grammar has ended
    allows only its stop tokens, and a vocabulary that cannot continue the grammar raises a
    ``RuntimeError`` saying so instead of silently sampling from an all ``-inf`` row.
    """

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.matchers: list = []
        self.bitmask = None
        self.steps = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import xgrammar as xgr

        if not self.matchers:
            self.matchers = [xgr.GrammarMatcher(self.compiled) for _ in range(input_ids.shape[0])]
            self.bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], self.compiled.tokenizer_info.vocab_size)
        elif self.steps:
            for row, matcher in enumerate(self.matchers):
                if not matcher.is_terminated() and not matcher.accept_token(int(input_ids[row, -1])):
                    token = int(input_ids[row, -1])
                    raise RuntimeError(f"token {token} breaks the grammar (a processor after the mask changed the choice?)")
        self.steps += 1
        for row, matcher in enumerate(self.matchers):
            if not matcher.is_terminated():  # a finished row keeps its last mask (its stop tokens)
                matcher.fill_next_token_bitmask(self.bitmask, row)
        masked = scores.to("cpu", copy=True)
        xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        if torch.isneginf(masked).all(dim=-1).any():
            raise RuntimeError("no token of this vocabulary can continue the grammar "
                               "(the tokenizer cannot spell JSON?)")
        return masked.to(scores.device)
