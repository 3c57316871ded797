"""``selective``: recompute the first tokens of every reused chunk that starts a seam (EPIC / LegoLink)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvboost_hf.reuse.repair.base import RepairContext, RepairOutcome, assemble_in_order
from kvboost_hf.reuse.repair.registry import RepairSettings, register_strategy


@register_strategy
@dataclass
class SelectiveRepair:
    """Recompute the first ``seam_tokens`` of every moved chunk with its true preceding context.

    A chunk encoded on its own treats its first tokens as attention sinks; recomputing them in
    place removes most of the error for the cost of ``seam_tokens`` per seam. A stored chunk
    that continues the previous hit's own text has no seam and is loaded whole. The tokens after
    the last hit are always computed.
    """

    seam_tokens: int = 16
    name: ClassVar[str] = "selective"
    attention: ClassVar[str | None] = None

    @classmethod
    def from_settings(cls, settings: RepairSettings) -> SelectiveRepair:
        return cls(seam_tokens=settings.seam_tokens)

    def repair(self, ctx: RepairContext) -> RepairOutcome:
        return assemble_in_order(ctx, seam_tokens=self.seam_tokens)
