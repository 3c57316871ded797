"""Per-model reuse state: what :func:`kvboost_hf.enable_chunk_reuse` installed on one model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_hf.cache.stats import ReuseStats
from kvboost_hf.models.rope import RopeShifter
from kvboost_hf.reuse.segments import segment_starts
from kvboost_hf.store import ChunkStore

STATE_ATTR = "_kvboost_reuse"



@dataclass
class ReuseState:
    """What :func:`kvboost_hf.enable_chunk_reuse` installed on one model."""

    store: ChunkStore
    hooks: list = field(default_factory=list)
    last_stats: ReuseStats | None = None
    strategy: Any = None  # None: exact prefix reuse only
    shifter: RopeShifter | None = None
    approximate_refusal: str = ""  # why moved chunks are not reused on this model
    turn_tokens: tuple[int, ...] = ()
    separator: tuple[int, ...] = ()
    leading_special: tuple[int, ...] = ()
    original_attention: str | None = None
    # Per-extension state, keyed by the extension's name (kvboost_hf.generation.extension): a generate
    # extension keeps what it needs across requests here, and it goes when reuse is disabled.
    extensions: dict[str, Any] = field(default_factory=dict)

    def boundaries(self, token_ids: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        return segment_starts(token_ids, self.turn_tokens, self.separator, extra, self.leading_special)


def reuse_state(model: torch.nn.Module) -> ReuseState | None:
    """The reuse state installed on ``model`` (the transformers model itself), or None."""
    return model.__dict__.get(STATE_ATTR)
