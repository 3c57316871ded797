"""``MeasuredCandidateGenerator``: the candidate generator generate() runs, timing every round.

It asks the :class:`DraftController` for a draft length, asks its proposer for that many
tokens, and measures the draft time (inside ``get_candidates``) and the verify time (from the
end of ``get_candidates`` to generate's ``update_candidate_strategy`` call: the target forward
and the acceptance test). On targets that need it, that forward's attention is routed per row
(:mod:`.exact_rows`).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from kvboost_hf.speculative.controller import DraftController
from kvboost_hf.speculative.draft_limits import DraftLimits
from kvboost_hf.speculative.exact_rows import route_rows
from kvboost_hf.speculative.stats import SpeculationStats
from kvboost_hf.speculative.verify_head import measuring_seconds


class Proposer(Protocol):
    name: str
    takes_prompt_from_target: bool  # waits for the target's prefill to take its prompt K/V from (optional)

    def propose(self, input_ids: torch.LongTensor, k: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """``input_ids`` followed by at most ``k`` draft tokens, and the draft's logits (or None)."""

    def update(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None: ...

    def finish(self, sequence: torch.LongTensor): ...

    def unseen(self, input_ids: torch.LongTensor) -> int:
        """Tokens of ``input_ids`` the proposer must forward before it can draft (0 for lookups)."""


class FixedProposer:
    """An HF candidate generator used as is (it picks its own draft length): telemetry only."""

    def __init__(self, inner: CandidateGenerator, name: str) -> None:
        self.inner, self.name = inner, name

    def propose(self, input_ids: torch.LongTensor, k: int):
        return self.inner.get_candidates(input_ids)

    def update(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        self.inner.update_candidate_strategy(input_ids, scores, num_matches)

    def finish(self, sequence: torch.LongTensor) -> None:
        return None

    def unseen(self, input_ids: torch.LongTensor) -> int:
        return 0


class MeasuredCandidateGenerator(CandidateGenerator):
    """Drafts through ``proposer`` with lengths chosen by ``controller``; records ``stats``."""

    def __init__(self, proposer: Proposer, controller: DraftController | None, stats: SpeculationStats,
                 max_length: int, exact_rows: bool = False, limits: DraftLimits | None = None) -> None:
        self.proposer, self.controller, self.stats, self.max_length = proposer, controller, stats, max_length
        self.exact_rows = exact_rows
        self.limits = limits if limits else None
        # A proposer that drafts with the target's own cache reads generate's model kwargs: transformers
        # passes them to get_candidates of a generator that requires model outputs (and merges no overrides).
        self.requires_model_outputs = hasattr(proposer, "model_kwargs")
        self.model_kwargs_overrides: dict = {}
        self._drafted, self._draft_ms, self._drafted_at, self._measured_at, self._unseen = 0, 0.0, 0.0, 0.0, 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        start = time.perf_counter()
        if self.requires_model_outputs:
            self.proposer.model_kwargs = kwargs.get("model_kwargs")
        room = max(0, self.max_length - input_ids.shape[1] - 1)  # the target adds one token itself
        counted: list[int] = []

        def unseen() -> int:  # asked only when it matters: a model draft's first call may ask the store
            if not counted:
                counted.append(self.proposer.unseen(input_ids))
            return counted[0]

        if self.controller is None:
            k = room
        elif self.stats.rounds == 0 and (self.exact_rows or getattr(self.proposer, "takes_prompt_from_target", False)):
            # A round-0 draft would ride on the prompt prefill, which plain decoding batches (row-exact
            # targets), or make a self-draft forward the prompt it can take from the target's prefill.
            k = 0
            self.stats.record_choice(k)
        else:
            k = min(self.controller.choose(unseen, room), room)
            self.stats.record_choice(k)
        # Counted before proposing: proposing forwards the unseen tokens, after which none are left.
        self._unseen = unseen() if k > 0 else 0
        candidates, logits = self.proposer.propose(input_ids, k) if k > 0 else (input_ids, None)
        if self.limits is not None and candidates.shape[1] > input_ids.shape[1]:
            candidates, logits = self._limit(input_ids, candidates, logits)
        self._drafted = candidates.shape[1] - input_ids.shape[1]
        self._drafted_at, self._measured_at = time.perf_counter(), measuring_seconds()
        self._draft_ms = (self._drafted_at - start) * 1000.0
        if self.exact_rows and self.stats.rounds > 0:
            route_rows(self._drafted + 1)  # the next target forward: these candidates (or none) + 1
        return candidates, logits

    def _limit(self, input_ids: torch.LongTensor, candidates: torch.LongTensor, logits: torch.Tensor | None):
        """The proposal cut before a stop string completes or a grammar rejects a token (:mod:`.draft_limits`)."""
        start = input_ids.shape[1]
        keep = self.limits.allowed(input_ids, candidates[0, start:])
        if keep == candidates.shape[1] - start:
            return candidates, logits
        return candidates[:, : start + keep], None if logits is None else logits[:, :keep]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        verify_ms = (time.perf_counter() - self._drafted_at) * 1000.0
        one_off_ms = (measuring_seconds() - self._measured_at) * 1000.0  # the LM head's first call at a row count
        if self.exact_rows:
            route_rows(None)
        accepted = int(num_matches)
        first = self.stats.rounds == 0
        self.stats.record_round(self._drafted, accepted, self._draft_ms, verify_ms, first)
        if self.controller is not None:
            self.controller.observe(self._drafted, accepted, self._draft_ms, verify_ms - one_off_ms, self._unseen)
            self.stats.off_reason = self.controller.off_reason
        if self._drafted:
            self.proposer.update(input_ids, scores, num_matches)
