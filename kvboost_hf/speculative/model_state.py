"""What speculation keeps per model across requests: the default draft, running totals, learnt costs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvboost_hf.reuse import ReuseState
from kvboost_hf.speculative.controller import ControllerSettings
from kvboost_hf.speculative.totals import SpeculationTotals

EXTENSION_NAME = "speculation"
_create_lock = threading.Lock()


@dataclass
class SpeculativeModelState:
    default_draft: Any = None  # what generate(draft=...) accepts; set_default_draft
    default_settings: ControllerSettings | None = None
    totals: SpeculationTotals = field(default_factory=SpeculationTotals)
    costs: dict = field(default_factory=dict)  # draft key -> CostMemory of its last request


def model_state(state: ReuseState) -> SpeculativeModelState:
    """Speculation's state on a model with reuse enabled (created on first use; it goes with reuse)."""
    with _create_lock:
        return state.extensions.setdefault(EXTENSION_NAME, SpeculativeModelState())
