"""``none``: stitch stored chunks in place without any repair (the baseline of the quality report)."""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_hf.repair.base import RepairContext, RepairOutcome, assemble_in_order


@dataclass
class StitchOnly:
    """Moved chunks keep the K/V they were computed with; only gaps and the tail are computed."""

    name: str = "none"

    def repair(self, ctx: RepairContext) -> RepairOutcome:
        return assemble_in_order(ctx, seam_tokens=0)
