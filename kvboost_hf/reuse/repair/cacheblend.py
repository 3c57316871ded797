"""``cacheblend``: layer-wise selective recompute of the tokens whose K/V deviate most (CacheBlend, EuroSys 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvboost_hf.models.attention import ATTENTION_NAME, ScatteredQueries, set_scattered_queries
from kvboost_hf.reuse.repair.base import RepairContext, RepairOutcome
from kvboost_hf.reuse.repair.registry import RepairSettings, register_strategy


@register_strategy
@dataclass
class CacheBlendRepair:
    """Every prompt token runs through layers ``0..check_layer``; there the reused tokens whose
    fresh keys deviate most from the stored ones (top ``recompute_ratio``), every uncached token
    and the tokens after the last hit are selected, and the real forward computes only those
    through the whole model, attending over the blended cache (positions in order, masks by
    position). Cost: about ``(c + 1 + r (L - c - 1)) / L`` of a prefill, plus ``r (c + 1) / L``
    for recomputing the selected tokens' first layers in the same pass.
    """

    recompute_ratio: float = 0.15
    check_layer: int = 1
    name: ClassVar[str] = "cacheblend"
    attention: ClassVar[str | None] = ATTENTION_NAME  # scattered queries, masks by position

    @classmethod
    def from_settings(cls, settings: RepairSettings) -> CacheBlendRepair:
        return cls(recompute_ratio=settings.recompute_ratio, check_layer=settings.check_layer)

    def repair(self, ctx: RepairContext) -> RepairOutcome:
        plan, cache = ctx.plan, ctx.cache
        prompt_len, start = plan.prompt_len, plan.exact_len
        check = min(self.check_layer, len(cache.layers) - 1)
        ctx.compute(start, prompt_len, stop_after_layer=check, track=False)

        fresh_keys = cache.layers[check].full_states()[0]
        reused = torch.zeros(prompt_len, dtype=torch.bool)
        deviation = torch.zeros(prompt_len)
        for hit in plan.hits:
            stored = ctx.hit_states(hit, check)[0][:1]
            fresh = fresh_keys[:1, :, hit.start : hit.start + hit.num_tokens]
            deviation[hit.start : hit.start + hit.num_tokens] = (fresh - stored).float().norm(dim=-1).sum(dim=1)[0].cpu()
            reused[hit.start : hit.start + hit.num_tokens] = True
        num_reused = int(reused.sum())
        keep = max(0, math.ceil(self.recompute_ratio * num_reused))
        selected = ~reused
        selected[:start] = False
        if keep:
            top = torch.topk(torch.where(reused, deviation, torch.full_like(deviation, -1.0)), keep).indices
            selected[top] = True
        positions = selected.nonzero().flatten().to(plan.input_ids.device)

        buffers = []
        for i, layer in enumerate(cache.layers):
            keys, values = layer.full_states() if (i <= check or start) else (None, None)
            if i <= check:  # fresh K/V of every position from the first pass
                buffers.append((keys[..., :prompt_len, :].clone(), values[..., :prompt_len, :].clone()))
                continue
            # Layers past the check layer hold only the exact prefix (nothing at all without one).
            states = [ctx.hit_states(hit, i) for hit in plan.hits]
            k0, v0 = states[0]
            k_buf = k0.new_zeros((*k0.shape[:2], prompt_len, k0.shape[-1]))
            v_buf = v0.new_zeros((*v0.shape[:2], prompt_len, v0.shape[-1]))
            if start:
                k_buf[..., :start, :], v_buf[..., :start, :] = keys[..., :start, :], values[..., :start, :]
            for hit, (k, v) in zip(plan.hits, states):
                k_buf[..., hit.start : hit.start + hit.num_tokens, :] = k
                v_buf[..., hit.start : hit.start + hit.num_tokens, :] = v
            buffers.append((k_buf, v_buf))
        cache.begin_blend(buffers, positions)
        cache.track(plan.input_ids[0, start:prompt_len])
        set_scattered_queries(ScatteredQueries(positions, prompt_len))
        layer_tokens = [n + positions.numel() for n in ctx.layer_tokens]
        return RepairOutcome(positions, num_reused - keep, layer_tokens, tracked=True)
