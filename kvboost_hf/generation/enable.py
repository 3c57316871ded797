"""Switching reuse on and off for a model, and reading what the latest request reused."""

from __future__ import annotations

import logging

import torch

from kvboost_hf.cache import ReuseStats
from kvboost_hf.generation import model_class
from kvboost_hf.models import attention
from kvboost_hf.models.fingerprint import UnfingerprintableModel
from kvboost_hf.models.namespace import namespace
from kvboost_hf.models.rope import RopeShifter, UnsupportedRope
from kvboost_hf.models.shape import chunk_entry_bytes, model_shape
from kvboost_hf.models.target import target_model
from kvboost_hf.reuse import STATE_ATTR, ReuseState, install, reuse_state
from kvboost_hf.reuse.repair import make_strategy
from kvboost_hf.reuse.segments import separator_ids, turn_start_ids
from kvboost_hf.store import ChunkStore

logger = logging.getLogger(__name__)


def enable_chunk_reuse(
    model: torch.nn.Module,
    store: ChunkStore,
    recompute_strategy: str | None = None,
    recompute_ratio: float = 0.15,
    seam_tokens: int = 16,
    *,
    check_layer: int = 1,
    tokenizer=None,
    separator: str | None = None,
) -> torch.nn.Module:
    """Make ``model.generate`` reuse K/V across requests through ``store``. Idempotent.

    ``recompute_strategy=None`` (default) reuses exact prefixes only: output is token-identical
    to plain ``generate``. ``"none"``, ``"selective"`` or ``"cacheblend"`` also reuse stored
    chunks found anywhere in the prompt (moved with :class:`RopeShifter`, repaired by that
    strategy); those tokens are reported as approximate. ``recompute_ratio`` is cacheblend's
    share of reused tokens recomputed, ``seam_tokens`` selective's tokens recomputed per seam.
    ``tokenizer`` lets chunk boundaries follow chat turns, and ``separator`` (a string) too.
    ``"exact"`` is a synonym of ``None``. Calling it again replaces the settings.

    The model's namespace (a hash of every weight byte, ~70 ms per GB) is computed here, so the
    first request does not pay it. ``copy.deepcopy(model)`` / ``torch.save(model)`` give the
    plain model without reuse. Returns ``model``.
    """
    if not isinstance(store, ChunkStore):
        raise TypeError(f"store must be a ChunkStore, got {type(store).__name__}")
    if recompute_strategy == "exact":
        recompute_strategy = None
    strategy = None if recompute_strategy is None else make_strategy(
        recompute_strategy, recompute_ratio, seam_tokens, check_layer
    )
    target = target_model(model)
    shape = model_shape(target)
    store.check_model(shape.head_dim)
    chunk_bytes = chunk_entry_bytes(shape, store.chunk_size)
    if chunk_bytes > store.max_bytes:
        raise ValueError(
            f"ChunkStore(max_bytes={store.max_bytes}) cannot hold one {store.chunk_size}-token chunk of this "
            f"model's K/V ({chunk_bytes} bytes): raise max_bytes or lower chunk_size"
        )
    needed = strategy.attention if strategy is not None else None  # e.g. cacheblend's kvboost_sdpa
    if needed == attention.ATTENTION_NAME:
        attn = attention.attention_implementation(target.config)
        if attn not in attention.SDPA_IMPLEMENTATIONS:
            raise ValueError(
                f"recompute_strategy={strategy.name!r} needs SDPA attention (the model uses {attn!r}): load the "
                "model with attn_implementation='sdpa', or use recompute_strategy='selective'"
            )
    state = reuse_state(target)
    if state is None:
        state = ReuseState(store=store)
        state.hooks = install(target)
        setattr(target, STATE_ATTR, state)
        model_class.attach(target)
    state.store, state.strategy = store, strategy
    state.turn_tokens = turn_start_ids(tokenizer)
    state.separator = separator_ids(tokenizer, separator)
    bos = getattr(target.config, "bos_token_id", None)
    state.leading_special = tuple(b for b in (bos if isinstance(bos, list) else [bos]) if b is not None)
    state.shifter, state.approximate_refusal = None, ""
    if strategy is not None:
        try:
            state.shifter = RopeShifter.for_model(target)
        except UnsupportedRope as err:
            state.approximate_refusal = f"moved chunks are not reused: {err}"
            logger.warning("%s; recompute_strategy=%r falls back to exact prefix reuse", state.approximate_refusal,
                           recompute_strategy)
    if needed is not None and attention.attention_implementation(target.config) != needed:
        state.original_attention = attention.switch(target, needed)
    try:
        namespace(target)
    except UnfingerprintableModel as err:
        logger.warning("chunk reuse will step aside for this model: %s", err)
    return model


def disable_chunk_reuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_chunk_reuse` (the store keeps its entries). Returns ``model``."""
    target = target_model(model)
    state = reuse_state(target)
    if state is not None:
        for hook in state.hooks:
            hook.remove()
        model_class.detach(target)
        if state.original_attention is not None:
            attention.switch(target, state.original_attention)
        delattr(target, STATE_ATTR)
    return model


def is_chunk_reuse_enabled(model: torch.nn.Module) -> bool:
    return reuse_state(target_model(model)) is not None


def last_request_stats(model: torch.nn.Module) -> ReuseStats | None:
    """Reuse statistics of the latest generate call (or ``warm``) on ``model``; None before any."""
    state = reuse_state(target_model(model))
    return None if state is None else state.last_stats
