"""The forward hooks that make a ``generate`` call reuse stored K/V.

At the first forward of a request the pre-hook looks the prompt up in the store, loads the
matching K/V into the :class:`~kvboost_hf.cache.ChunkReuseCache` (placing and repairing moved
chunks with the configured :mod:`~kvboost_hf.reuse.repair` strategy) and trims the inputs so
only the uncached tail runs; on every forward it records which tokens the cache now holds.
Choosing the cache for a call and storing what it confirmed is the generation layer's job
(:mod:`kvboost_hf.generation.wrapper`, :mod:`kvboost_hf.reuse.commit`).
"""

from __future__ import annotations

import time

import torch

from kvboost_hf.cache import ChunkReuseCache, ReuseStats
from kvboost_hf.cache.chunk_reuse import ReuseRequest
from kvboost_hf.models import attention
from kvboost_hf.models.fingerprint import UnfingerprintableModel
from kvboost_hf.models.namespace import namespace
from kvboost_hf.reuse.lookup import (
    can_continue,
    continue_prefix,
    is_later_prefill_chunk,
    load_prefix,
    per_position_outputs,
    refusal,
    rope_refusal,
    select_inputs,
)
from kvboost_hf.reuse.repair import RepairContext, ReusePlan, in_inner_forward
from kvboost_hf.reuse.state import ReuseState, reuse_state
from kvboost_hf.store.scope import CacheScope


def install(model: torch.nn.Module) -> list:
    """Register the reuse hooks on ``model`` (the transformers model); returns their handles."""
    return [
        model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
        model.register_forward_hook(_post_forward, with_kwargs=True),
    ]


def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, ChunkReuseCache) or in_inner_forward():
        return None
    input_ids = kwargs.get("input_ids")
    if input_ids is None and args and isinstance(args[0], torch.Tensor):
        kwargs["input_ids"], args = args[0], args[1:]
        input_ids = kwargs["input_ids"]
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        if cache.request is None:
            cache.stats = ReuseStats(reason="inputs_embeds input: no reuse")
            cache.request = ReuseRequest()
        cache.untrack()
        return None
    if cache.request is None:
        state = reuse_state(module)
        if state is not None:
            start_request(module, state, cache, input_ids, kwargs)
            return args, kwargs
    elif is_later_prefill_chunk(cache, input_ids, kwargs):
        cache.stats.prompt_tokens += input_ids.shape[1]
        cache.stats.recomputed_tokens += input_ids.shape[1]
        if can_continue(module, cache, input_ids, kwargs):
            continue_prefix(cache, input_ids, kwargs)  # chunked prefill: reuse for every chunk
            return args, kwargs
    if cache.trackable:
        cache.track(input_ids[0])
    return args, kwargs


def _post_forward(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, ChunkReuseCache) and cache.blending and not in_inner_forward():
        attention.set_scattered_queries(None)
        cache.end_blend()
    return None


def start_request(module: torch.nn.Module, state: ReuseState, cache: ChunkReuseCache, input_ids: torch.Tensor,
                  kwargs: dict) -> None:
    """The first forward of a request: look the prompt up, load what the store holds (repairing moved
    chunks with the state's strategy), and trim ``kwargs`` so only the rest is forwarded."""
    start_time = time.perf_counter()
    prompt_len = input_ids.shape[-1]
    stats = ReuseStats(prompt_tokens=prompt_len, recomputed_tokens=prompt_len)
    cache.stats = stats
    cache.request = request = ReuseRequest(prompt_tokens=prompt_len)
    if cache.store is None:  # e.g. a prompt cache built with a direct forward: use the enabled store
        cache.store = state.store
    reason = refusal(cache, kwargs, input_ids) or rope_refusal(module)
    if reason:
        stats.reason = reason
        stats.layer_tokens = [prompt_len] * len(cache.layers)
        cache.untrack()
        return
    try:
        model_namespace = namespace(module)
    except UnfingerprintableModel as err:
        stats.reason = f"model weights cannot be fingerprinted: {err}"
        stats.layer_tokens = [prompt_len] * len(cache.layers)
        cache.untrack()
        return
    scope = cache.scope or CacheScope()
    cache.store.follow_purges(scope.owner)  # another replica's purge reaches this one (with a Redis tier)
    request.namespace, request.shared = scope.root(model_namespace), scope.shared_root(model_namespace)
    request.owner = scope.owner
    request.epoch = scope.epoch if scope.epoch is not None else cache.store.epoch(scope.owner)
    if input_ids.shape[0] > 1:
        request.commit_limit = cache.num_tokens + prompt_len
    reused = exact = 0
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    can_skip = isinstance(logits_to_keep, int) and logits_to_keep > 0 and kwargs.get("labels") is None
    per_position = per_position_outputs(module, kwargs)
    if cache.num_tokens:
        if can_continue(module, cache, input_ids, kwargs):
            continue_prefix(cache, input_ids, kwargs)
            stats.lookup_ms = (time.perf_counter() - start_time) * 1000.0
            return
        stats.reason = "continuing a pre-filled cache"
    elif not can_skip:
        stats.reason = "forward needs logits of every position"
    elif per_position:
        stats.reason = f"{per_position}=True returns every prompt position: no reuse (the prompt is still stored)"
    else:
        limit = prompt_len - logits_to_keep
        reused, exact = load_prefix(cache, request.namespace, input_ids, limit)
        if state.strategy is not None and state.approximate_refusal:
            stats.reason = state.approximate_refusal
        elif state.strategy is not None and exact == reused and reused < limit:
            hits = cache.store.lookup_content(request.namespace, input_ids[0].tolist(), reused, limit)
            if hits:
                _repair(module, state, cache, ReusePlan(input_ids, reused, hits), kwargs, stats, start_time)
                return
        if reused:
            select_inputs(kwargs, slice(reused, None), prompt_len)
    cache.track(input_ids[0, reused:])
    num_layers = len(cache.layers)
    stats.reused_tokens, stats.exact_tokens, stats.approximate_tokens = reused, exact, reused - exact
    stats.recomputed_tokens = prompt_len - reused
    stats.layer_tokens = [prompt_len - reused] * num_layers
    stats.lookup_ms = (time.perf_counter() - start_time) * 1000.0


def _repair(module, state: ReuseState, cache, plan: ReusePlan, kwargs: dict, stats: ReuseStats, start_time) -> None:
    """Place the content hits of ``plan`` with the configured strategy and trim the real forward to what is left."""
    prompt_len, input_ids = plan.prompt_len, plan.input_ids
    ctx = RepairContext(module, cache, plan, state.shifter)
    outcome = state.strategy.repair(ctx)
    positions = outcome.positions
    if outcome.contiguous:
        select_inputs(kwargs, slice(int(positions[0]) if positions.numel() else prompt_len, None), prompt_len)
    else:
        if kwargs.get("position_ids") is None:  # scattered queries cannot infer positions from the cache
            kwargs["position_ids"] = torch.arange(prompt_len, device=input_ids.device).expand(input_ids.shape[0], -1)
        select_inputs(kwargs, positions, prompt_len)
    if not outcome.tracked:
        cache.track(input_ids[0, prompt_len - positions.numel() :])
    # Everything from the first moved chunk on attends to approximate K/V: never store it as exact.
    cache.request.commit_limit = min(cache.request.commit_limit or prompt_len, plan.hits[0].start)
    approximate = outcome.approximate_tokens
    stats.exact_tokens = plan.exact_len
    stats.approximate_tokens = approximate
    stats.reused_tokens = plan.exact_len + approximate
    stats.recomputed_tokens = prompt_len - stats.reused_tokens
    stats.layer_tokens = outcome.layer_tokens
    stats.strategy = state.strategy.name
    stats.lookup_ms = (time.perf_counter() - start_time) * 1000.0
