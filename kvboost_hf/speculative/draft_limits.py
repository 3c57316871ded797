"""Where a draft must end: before a stop string completes, and where a constraint stops accepting tokens.

transformers' assisted decoding appends every accepted candidate at once and then asks the
stopping criteria about the end of the sequence only (it crops at EOS and at the length limit,
nothing else). A stop string completed by an accepted draft token in the middle of a round would
be missed and decoding would run on. So a draft is cut before the first token that completes a
stop: the stop can then only be completed by the target's own token, the last one of a round,
where the criteria see it, and the output is the one plain decoding gives.

Constraints are logits processors that mask tokens by a grammar (the server's ``GrammarMask``):
they expose ``allowed_prefix(input_ids, draft) -> int``. A draft token the mask forbids is one the
target can never accept, so the draft is cut before it rather than wasting the round.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers.generation.stopping_criteria import StopStringCriteria

logger = logging.getLogger(__name__)


@runtime_checkable
class DraftConstraint(Protocol):
    """A logits processor that can say how much of a draft it would allow after ``input_ids`` (batch 1)."""

    def allowed_prefix(self, input_ids: torch.LongTensor, draft: Sequence[int]) -> int: ...


@runtime_checkable
class PureStop(Protocol):
    """A stopping criterion that can be asked about a hypothetical sequence without changing its state."""

    def would_stop(self, input_ids: torch.LongTensor) -> bool: ...


class DraftLimits:
    """Cuts proposals (``input_ids`` followed by draft tokens) at constraints and stop strings."""

    def __init__(self, constraints: Sequence[DraftConstraint] = (), stops: Sequence[object] = ()) -> None:
        self.constraints = list(constraints)
        self.stops = list(stops)  # StopStringCriteria or PureStop

    def __bool__(self) -> bool:
        return bool(self.constraints or self.stops)

    def allowed(self, input_ids: torch.LongTensor, draft: torch.LongTensor) -> int:
        """How many leading tokens of ``draft`` (1-D) the target may be asked to verify."""
        tokens = draft.tolist()
        n = len(tokens)
        for constraint in self.constraints:
            n = min(n, constraint.allowed_prefix(input_ids, tokens[:n]))
        if self.stops and n:
            n = self._before_stop(input_ids, draft[:n])
        return n

    def _before_stop(self, input_ids: torch.LongTensor, draft: torch.LongTensor) -> int:
        for i in range(draft.shape[0]):
            candidate = torch.cat([input_ids, draft[None, : i + 1].to(input_ids.device)], dim=1)
            if any(_stops(stop, candidate) for stop in self.stops):
                return i  # the token completing the stop is left to the target
        return draft.shape[0]


def _stops(criterion, input_ids: torch.LongTensor) -> bool:
    if isinstance(criterion, PureStop):
        return bool(criterion.would_stop(input_ids))
    return bool(criterion(input_ids, None).any())


def draft_limits(logits_processor: Iterable | None, stop_strings, tokenizer, stopping_criteria: Iterable | None) -> DraftLimits:
    """The limits of one request: its grammar processors, its ``stop_strings`` (with ``tokenizer``), and the
    caller's stopping criteria that can be asked without side effects (HF's ``StopStringCriteria`` and any
    :class:`PureStop`). Other custom criteria are left alone: they may count calls or keep state."""
    constraints = [p for p in logits_processor or () if isinstance(p, DraftConstraint)]
    stops: list = [c for c in stopping_criteria or () if isinstance(c, (StopStringCriteria, PureStop))]
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs tokenizer= in generate() (as in transformers)")
        stops.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return DraftLimits(constraints, stops)
