"""N-gram continuation index: the most recent continuation of the longest n-gram matching a context's end.

Used twice: over the current request (prompt lookup, growing as tokens are confirmed) and over
every token sequence the store holds (retrieval-based drafting, as in REST / SuffixDecoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LookupSettings:
    """``max_ngram`` .. ``min_ngram``: the n-gram sizes matched, longest first."""

    max_ngram: int = 4
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


@dataclass(frozen=True)
class Proposal:
    """``tokens`` continuing a match of ``ngram`` tokens."""

    tokens: tuple[int, ...]
    ngram: int


class NgramIndex:
    """Token sequences indexed by every n-gram (``min_ngram..max_ngram``) that has a continuation.

    ``add_sequence`` indexes a finished sequence; ``extend`` grows the last one token by token
    (an n-gram is indexed once the token after it is known). A later occurrence replaces an
    earlier one: the most recent continuation wins. Not thread safe.
    """

    def __init__(self, settings: LookupSettings | None = None) -> None:
        self.settings = settings or LookupSettings()
        self.sequences: list[list[int]] = []
        self._where: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (sequence, continuation start)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sequences)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        self.sequences.append([])
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the last sequence (a new one if there is none)."""
        if not self.sequences:
            self.sequences.append([])
        seq, index = self.sequences[-1], len(self.sequences) - 1
        lo, hi = self.settings.min_ngram, self.settings.max_ngram
        for token in tokens:
            seq.append(int(token))
            end = len(seq) - 1  # the new token continues every n-gram ending just before it
            for n in range(lo, min(hi, end) + 1):
                self._where[tuple(seq[end - n : end])] = (index, end)

    def propose(self, context: Sequence[int], max_tokens: int) -> Proposal | None:
        """Up to ``max_tokens`` tokens that followed the longest n-gram ending ``context``, or None.

        A continuation that runs into the end of its sequence is continued by looking up again after
        it (``context`` and the tokens drafted so far): in text that repeats, the most recent occurrence
        of an n-gram is one period back, and its continuation alone stops short at the sequence's end
        (the loops of greedy decoding, copied lists). ``ngram`` is the first match's length."""
        if max_tokens <= 0:
            return None
        first = self._continuation(context, max_tokens)
        if first is None:
            return None
        tokens, ngram = list(first[0]), first[1]
        while 0 < len(tokens) < max_tokens:
            more = self._continuation([*context[len(context) - self.settings.max_ngram :], *tokens],
                                      max_tokens - len(tokens))
            if more is None or not more[0]:
                break
            tokens.extend(more[0])
        return Proposal(tuple(tokens), ngram)

    def _continuation(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int] | None:
        lo, hi = self.settings.min_ngram, self.settings.max_ngram
        for n in range(min(hi, len(context)), lo - 1, -1):
            hit = self._where.get(tuple(context[len(context) - n :]))
            if hit is not None:
                seq = self.sequences[hit[0]]
                return seq[hit[1] : hit[1] + max_tokens], n
        return None
