"""``none``: stitch stored chunks in place without any repair (the baseline of the quality report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvboost_hf.reuse.repair.base import RepairContext, RepairOutcome, assemble_in_order
from kvboost_hf.reuse.repair.registry import RepairSettings, register_strategy


@register_strategy
@dataclass
class StitchOnly:
    """Moved chunks keep the K/V they were computed with; only gaps and the tail are computed."""

    name: ClassVar[str] = "none"
    attention: ClassVar[str | None] = None

    @classmethod
    def from_settings(cls, settings: RepairSettings) -> StitchOnly:
        return cls()

    def repair(self, ctx: RepairContext) -> RepairOutcome:
        return assemble_in_order(ctx, seam_tokens=0)
