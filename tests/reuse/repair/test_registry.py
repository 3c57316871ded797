"""Repair strategies by name: a strategy registered from outside is built and used by enable_chunk_reuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.reuse.repair import STRATEGIES, StitchOnly, make_strategy, register_strategy
from kvboost_hf.reuse.repair.base import assemble_in_order
from kvboost_hf.reuse.repair.registry import _strategies
from tests.conftest import make_tiny, random_ids


@dataclass
class CountingRepair:
    name: ClassVar[str] = "counting"
    attention: ClassVar[str | None] = None
    seam_tokens: int = 0
    calls: ClassVar[list] = []

    @classmethod
    def from_settings(cls, settings):
        return cls(seam_tokens=settings.seam_tokens)

    def repair(self, ctx):
        CountingRepair.calls.append(ctx.plan.prompt_len)
        return assemble_in_order(ctx, seam_tokens=self.seam_tokens)


@pytest.fixture
def counting():
    register_strategy(CountingRepair)
    CountingRepair.calls.clear()
    yield CountingRepair
    _strategies.pop("counting", None)


def test_the_built_in_strategies_in_order():
    assert STRATEGIES == ("none", "selective", "cacheblend")
    assert isinstance(make_strategy("none"), StitchOnly)
    with pytest.raises(ValueError, match="one of \\('none', 'selective', 'cacheblend'\\)"):
        make_strategy("blend")
    with pytest.raises(ValueError, match="recompute_ratio"):
        make_strategy("cacheblend", recompute_ratio=1.5)


def test_a_registered_strategy_repairs_moved_chunks(counting):
    model = make_tiny("llama")
    a, b = random_ids(16, 1), random_ids(16, 2)
    store = ChunkStore(max_bytes=10**8, chunk_size=8)
    enable_chunk_reuse(model, store, recompute_strategy="counting", seam_tokens=3)
    try:
        model.generate(torch.cat([a, b], dim=1), max_new_tokens=1, do_sample=False)
        model.generate(torch.cat([b, a], dim=1), max_new_tokens=1, do_sample=False)  # both chunks moved
        stats = last_request_stats(model)
    finally:
        disable_chunk_reuse(model)
    assert counting.calls == [32]
    assert stats.strategy == "counting" and stats.approximate_tokens > 0
