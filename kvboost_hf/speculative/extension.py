"""Speculative decoding as a generate extension (:mod:`kvboost_hf.generation.extension`), and the
per-model settings and totals a user or the server reads and sets."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvboost_hf.cache import ReuseStats
from kvboost_hf.generation.extension import call_cache
from kvboost_hf.models.target import target_model
from kvboost_hf.reuse import ReuseState, reuse_state
from kvboost_hf.speculative import request as speculation
from kvboost_hf.speculative.controller import ControllerSettings
from kvboost_hf.speculative.exact_rows import verifying
from kvboost_hf.speculative.head_draft import head_verification
from kvboost_hf.speculative.model_state import model_state
from kvboost_hf.speculative.totals import SpeculationTotals


class SpeculationSession:
    """One generate call that decodes speculatively."""

    def __init__(self, model: torch.nn.Module, state: ReuseState, request: speculation.SpeculationRequest) -> None:
        self.model, self.state, self.request = model, state, request

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            # Verification forwards route attention per row when they can.
            self.request.exact_rows = bool(stack.enter_context(verifying(self.model)))
            if self.request.kind == "head":  # its verification computes only the rows it did not
                stack.enter_context(head_verification(self.model))
            yield

    def candidate_generator(self, model, generator, generation_config, input_ids, logits_processor, tokenizer):
        return speculation.candidate_generator(model, self.request, generator, generation_config,
                                               logits_processor=logits_processor, tokenizer=tokenizer,
                                               target_cache=call_cache())

    def finish(self, output, stats: ReuseStats | None) -> None:
        """Store the draft's confirmed K/V, attach the request's speculation stats to its reuse stats,
        and add them to the model's totals and learnt costs."""
        request = self.request
        speculation.finish(request, output)
        if stats is not None:
            stats.speculation = request.stats
        mine = model_state(self.state)
        if request.controller is not None and request.settings.adaptive:
            mine.costs[request.memory_key] = request.controller.memory()
        if request.proposer is not None:
            mine.totals.add(request.stats)


class SpeculativeExtension:
    """Reads ``draft=`` / ``speculation=`` (and HF's assisted-decoding arguments) from a generate call."""

    def open(self, model: torch.nn.Module, kwargs: dict, inputs: torch.Tensor | None) -> SpeculationSession | None:
        request = speculation.prepare(model, kwargs, inputs)
        state = reuse_state(model)
        return None if request is None or state is None else SpeculationSession(model, state, request)


EXTENSION = SpeculativeExtension()


def set_default_draft(model: torch.nn.Module, draft, settings: ControllerSettings | None = None) -> None:
    """Make ``draft`` (what ``generate(draft=...)`` accepts; None: none) the draft of every generate call
    on ``model`` that names no draft, assistant or prompt lookup itself. Needs chunk reuse enabled."""
    state = reuse_state(target_model(model))
    if state is None:
        raise ValueError("set_default_draft needs chunk reuse: call kvboost_hf.enable_chunk_reuse(model, store) first")
    if draft is not None:
        speculation.validate_draft(model, draft)
    mine = model_state(state)
    mine.default_draft, mine.default_settings = draft, settings


def speculation_totals(model: torch.nn.Module) -> SpeculationTotals:
    """The model's running totals (an empty one before any speculative request or without reuse)."""
    state = reuse_state(target_model(model))
    return SpeculationTotals() if state is None else model_state(state).totals
