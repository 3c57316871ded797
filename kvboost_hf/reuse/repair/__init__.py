"""Repair strategies for reused chunks that moved position: one per file, registered by name.

Add one by writing a module with a class that implements
:class:`~kvboost_hf.reuse.repair.registry.RepairStrategy`, decorated with ``@register_strategy``,
and importing it here.
"""

from kvboost_hf.reuse.repair.base import RepairContext, RepairOutcome, ReusePlan, in_inner_forward

# isort: off
# Registration order is the order users see (flag choices, errors): cheapest repair first.
from kvboost_hf.reuse.repair.none import StitchOnly
from kvboost_hf.reuse.repair.selective import SelectiveRepair
from kvboost_hf.reuse.repair.cacheblend import CacheBlendRepair
# isort: on
from kvboost_hf.reuse.repair.registry import (
    RepairSettings,
    RepairStrategy,
    make_strategy,
    register_strategy,
    strategy_names,
)

STRATEGIES = strategy_names()

__all__ = [
    "STRATEGIES", "CacheBlendRepair", "RepairContext", "RepairOutcome", "RepairSettings", "RepairStrategy",
    "ReusePlan", "SelectiveRepair", "StitchOnly", "in_inner_forward", "make_strategy", "register_strategy",
    "strategy_names",
]
