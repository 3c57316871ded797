"""``GrammarMask``: the logits processor that keeps generation inside a compiled xgrammar grammar.

Its matcher state follows the tokens it is shown, not the number of calls: every call rolls each
row's matcher back to the longest common prefix of what it accepted and the row's generated tokens,
then feeds it the rest. Plain decoding shows it one more token per call; assisted decoding shows it
each candidate position of a verification (and a model draft's own generate shows it draft tokens
the target may reject), after which the next round starts from a shorter prefix. Either way the
mask at a position depends only on the tokens before it, so a draft changes nothing but speed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor

logger = logging.getLogger(__name__)


class _RowMatcher:
    """One row's xgrammar matcher and the generated tokens it has accepted (``valid``: all of them)."""

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.accepted: list[int] = []
        self.valid = True  # False: the last token shown broke the grammar (a draft the target will reject)

    def sync(self, generated: list[int]) -> None:
        """Make the matcher's state that after ``generated``: roll back what differs, accept the rest."""
        keep = _common_prefix(self.accepted, generated)
        if keep < len(self.accepted):
            self.matcher.rollback(len(self.accepted) - keep)
            del self.accepted[keep:]
        self.valid = True
        for token in generated[keep:]:
            if not self.matcher.accept_token(token):
                # Only a draft token can get here (the mask never allows it): the target's own token at
                # this position differs, so what is masked after it is never used. Stay at the valid prefix.
                self.valid = False
                logger.debug("token %d does not continue the grammar (a draft token the target rejects)", token)
                return
            self.accepted.append(token)

    def allowed(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar accepts after the current state (state unchanged)."""
        if not self.valid:
            return 0
        n = 0
        for token in draft:
            if not self.matcher.accept_token(int(token)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class GrammarMask(LogitsProcessor):
    """Masks every token the grammar does not allow next (one xgrammar matcher per batch row).

    Like xgrammar's own ``contrib.hf.LogitsProcessor``, plus: the state follows ``input_ids`` (see the
    module doc), a row whose grammar has ended allows only its stop tokens, a vocabulary that cannot
    continue the grammar raises a ``RuntimeError`` saying so instead of silently sampling from an all
    ``-inf`` row, and :meth:`allowed_prefix` tells a speculative draft where the grammar stops it.
    """

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.rows: list[_RowMatcher] = []
        self.bitmask = None
        self.prompt_len: int | None = None  # the length of the first call's input: the prompt

    def _sync(self, input_ids: torch.LongTensor) -> None:
        import xgrammar as xgr

        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
            self.rows = [_RowMatcher(self.compiled) for _ in range(input_ids.shape[0])]
            self.bitmask = xgr.allocate_token_bitmask(input_ids.shape[0], self.compiled.tokenizer_info.vocab_size)
        generated = input_ids[:, self.prompt_len :].tolist()
        for row, tokens in zip(self.rows, generated):
            row.sync(tokens)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        import xgrammar as xgr

        self._sync(input_ids)
        for i, row in enumerate(self.rows):
            if not row.matcher.is_terminated():  # a finished row keeps its last mask (stop tokens)
                row.matcher.fill_next_token_bitmask(self.bitmask, i)
        masked = scores.to("cpu", copy=True)
        xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        if torch.isneginf(masked).all(dim=-1).any():
            raise RuntimeError("no token of this vocabulary can continue the grammar "
                               "(the tokenizer cannot spell JSON?)")
        return masked.to(scores.device)

    def allowed_prefix(self, input_ids: torch.LongTensor, draft: Sequence[int]) -> int:
        """How many leading ``draft`` tokens the grammar accepts after ``input_ids`` (batch 1): a draft is
        cut there, since the target's mask rejects the next one anyway."""
        self._sync(input_ids)
        return self.rows[0].allowed(draft)

    def is_completed(self, row: int = 0) -> bool:
        """Whether row ``row``'s tokens so far complete the grammar (a whole JSON value)."""
        return bool(self.rows) and self.rows[row].valid and self.rows[row].matcher.is_completed()
