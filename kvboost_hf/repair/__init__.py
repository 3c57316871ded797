"""Seam-repair strategies for reused chunks that moved position, one per file."""

from __future__ import annotations

from kvboost_hf.repair.base import RepairContext, RepairOutcome, ReusePlan, in_inner_forward
from kvboost_hf.repair.cacheblend import CacheBlendRepair
from kvboost_hf.repair.none import StitchOnly
from kvboost_hf.repair.selective import SelectiveRepair

STRATEGIES = ("none", "selective", "cacheblend")


def make_strategy(name: str, recompute_ratio: float = 0.15, seam_tokens: int = 16, check_layer: int = 1):
    """The strategy called ``name`` with its settings; ``ValueError`` for unknown names or bad settings."""
    if name not in STRATEGIES:
        raise ValueError(f"recompute_strategy must be None (exact reuse only) or one of {STRATEGIES}, got {name!r}")
    if not 0.0 <= recompute_ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be in [0, 1], got {recompute_ratio!r}")
    if isinstance(seam_tokens, bool) or not isinstance(seam_tokens, int) or seam_tokens < 0:
        raise ValueError(f"seam_tokens must be a non-negative int, got {seam_tokens!r}")
    if name == "none":
        return StitchOnly()
    if name == "selective":
        return SelectiveRepair(seam_tokens=seam_tokens)
    return CacheBlendRepair(recompute_ratio=recompute_ratio, check_layer=check_layer)


__all__ = [
    "STRATEGIES", "CacheBlendRepair", "RepairContext", "RepairOutcome", "ReusePlan", "SelectiveRepair",
    "StitchOnly", "in_inner_forward", "make_strategy",
]
