"""Speculation counters summed over a model's requests (what a server reports), and the model's default draft."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvboost_hf.reuse import _target
from kvboost_hf.state import reuse_state
from kvboost_hf.speculative.controller import ControllerSettings
from kvboost_hf.speculative.stats import SpeculationStats


@dataclass
class SpeculationTotals:
    """Sums of :class:`SpeculationStats` over requests. Thread safe."""

    requests: int = 0
    switched_off: int = 0
    rounds: int = 0
    speculative_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    plain_ms: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stats: SpeculationStats) -> None:
        with self.lock:
            self.requests += 1
            self.switched_off += bool(stats.off_reason)
            for name in ("rounds", "speculative_rounds", "drafted_tokens", "accepted_tokens", "draft_ms",
                         "verify_ms", "plain_ms"):
                setattr(self, name, getattr(self, name) + getattr(stats, name))
            hist = self.accepted_histogram
            hist.extend([0] * (len(stats.accepted_histogram) - len(hist)))
            for i, n in enumerate(stats.accepted_histogram):
                hist[i] += n

    def to_dict(self) -> dict:
        with self.lock:
            out = {k: v for k, v in self.__dict__.items() if k != "lock"}
            out["accepted_histogram"] = list(self.accepted_histogram)
        out["acceptance_rate"] = out["accepted_tokens"] / out["drafted_tokens"] if out["drafted_tokens"] else 0.0
        return out


def set_default_draft(model: torch.nn.Module, draft, settings: ControllerSettings | None = None) -> None:
    """Make ``draft`` (what ``generate(draft=...)`` accepts; None: none) the draft of every generate call
    on ``model`` that names no draft, assistant or prompt lookup itself. Needs chunk reuse enabled."""
    state = reuse_state(_target(model))
    if state is None:
        raise ValueError("set_default_draft needs chunk reuse: call kvboost_hf.enable_chunk_reuse(model, store) first")
    if draft is not None:
        from kvboost_hf.speculative.request import validate_draft  # noqa: PLC0415

        validate_draft(model, draft)
    state.default_draft, state.default_speculation = draft, settings


def speculation_totals(model: torch.nn.Module) -> SpeculationTotals:
    """The model's running totals (an empty one before any speculative request or without reuse)."""
    state = reuse_state(_target(model))
    return SpeculationTotals() if state is None else totals_of(state)


_create_lock = threading.Lock()


def totals_of(state) -> SpeculationTotals:
    """The totals held by a reuse state (created on first use)."""
    with _create_lock:
        if state.speculation_totals is None:
            state.speculation_totals = SpeculationTotals()
        return state.speculation_totals
