"""Cross-request reuse inside ``model.generate``: a forward pre-hook plus a thin generate wrapper.

``enable_chunk_reuse(model, store)`` installs two things on the model instance:

- a forward pre-hook that, at the first forward of a request, looks the prompt up in the
  store, loads the matching K/V into the :class:`ChunkReuseCache` and trims the inputs so only
  the uncached tail runs; on every forward it records which tokens the cache now holds;
- a ``generate`` wrapper that hands generate a fresh ``ChunkReuseCache`` when the caller did
  not pass a cache, resets a reused one that does not match the new prompt, and writes the
  confirmed K/V back to the store when generation returns.

Everything else (sampling, logits processors, streamers, assisted decoding) is generate's own.
"""

from __future__ import annotations

import logging
import time

import torch

from kvboost_hf import attention, model_class
from kvboost_hf.cache import ChunkReuseCache, _Request, as_batch
from kvboost_hf.repair import RepairContext, ReusePlan, in_inner_forward, make_strategy
from kvboost_hf.rope import RopeShifter, UnsupportedRope
from kvboost_hf.segments import separator_ids, turn_start_ids
from kvboost_hf.state import STATE_ATTR, ReuseState, namespace, reuse_state
from kvboost_hf.store import ChunkStore
from kvboost_hf.store.codec import ENTRY_OVERHEAD_BYTES
from kvboost_hf.store.keys import Key, UnfingerprintableModel
from kvboost_hf.telemetry import ReuseStats

logger = logging.getLogger(__name__)


def _target(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward generate calls (unwraps torch.compile and peft wrappers)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if not hasattr(model, "generate") or not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a transformers generative model, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError("chunk reuse supports decoder-only models; this model is an encoder-decoder")
    return model


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of K/V one token costs in the store for ``model`` (all layers, keys and values)."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = _head_dim(model)
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element + 8


def _head_dim(model: torch.nn.Module) -> int:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


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
    target = _target(model)
    store.check_model(_head_dim(target))
    chunk_bytes = store.chunk_size * kv_bytes_per_token(target) + ENTRY_OVERHEAD_BYTES
    if chunk_bytes > store.max_bytes:
        raise ValueError(
            f"ChunkStore(max_bytes={store.max_bytes}) cannot hold one {store.chunk_size}-token chunk of this "
            f"model's K/V ({chunk_bytes} bytes): raise max_bytes or lower chunk_size"
        )
    if getattr(strategy, "name", None) == "cacheblend":
        attn = target.config._attn_implementation
        if attn not in attention.SDPA_IMPLEMENTATIONS:
            raise ValueError(
                f"recompute_strategy='cacheblend' needs SDPA attention (the model uses {attn!r}): load the model "
                "with attn_implementation='sdpa', or use recompute_strategy='selective'"
            )
    state = reuse_state(target)
    if state is None:
        state = ReuseState(store=store)
        state.hooks = [
            target.register_forward_pre_hook(_pre_forward, with_kwargs=True),
            target.register_forward_hook(_post_forward, with_kwargs=True),
        ]
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
    if getattr(strategy, "name", None) == "cacheblend" and target.config._attn_implementation == "sdpa":
        state.original_attention = "sdpa"
        target.set_attn_implementation(attention.register())
    try:
        namespace(target)
    except UnfingerprintableModel as err:
        logger.warning("chunk reuse will step aside for this model: %s", err)
    return model


def disable_chunk_reuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_chunk_reuse` (the store keeps its entries). Returns ``model``."""
    target = _target(model)
    state = reuse_state(target)
    if state is not None:
        for hook in state.hooks:
            hook.remove()
        model_class.detach(target)
        if state.original_attention is not None:
            target.set_attn_implementation(state.original_attention)
        delattr(target, STATE_ATTR)
    return model


def is_chunk_reuse_enabled(model: torch.nn.Module) -> bool:
    return reuse_state(_target(model)) is not None


def last_request_stats(model: torch.nn.Module) -> ReuseStats | None:
    """Reuse statistics of the latest generate call (or ``warm``) on ``model``; None before any."""
    state = reuse_state(_target(model))
    return None if state is None else state.last_stats


# ---------------------------------------------------------------------- forward pre-hook
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
            cache.request = _Request()
        cache.untrack()
        return None
    if cache.request is None:
        state = reuse_state(module)
        if state is not None:
            _start_request(module, state, cache, input_ids, kwargs)
            return args, kwargs
    elif _is_later_prefill_chunk(cache, input_ids, kwargs):
        cache.stats.prompt_tokens += input_ids.shape[1]
        cache.stats.recomputed_tokens += input_ids.shape[1]
        if _can_continue(module, cache, input_ids, kwargs):
            _continue_prefix(cache, input_ids, kwargs)  # chunked prefill: reuse for every chunk
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


def _refusal(cache: ChunkReuseCache, kwargs: dict, input_ids: torch.Tensor) -> str:
    """Why this request can neither reuse nor be stored ('' when it can)."""
    if cache.store is None:
        return "cache has no store"
    if not cache.supports_reuse:
        return "model has cache layers other than full / sliding attention"
    if cache.get_seq_length() and not cache.num_tokens:
        return "cache was filled without token tracking"
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        return "empty prompt"
    if input_ids.shape[0] > 1 and not bool((input_ids == input_ids[:1]).all()):
        return "batch rows differ"
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        return "padded batch"
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor):
        start = cache.num_tokens
        expected = torch.arange(start, start + input_ids.shape[1], device=positions.device)
        if positions.shape[-1] != input_ids.shape[1] or not bool((positions == expected).all()):
            return "custom position_ids"
    return ""


def _per_position_outputs(module: torch.nn.Module, kwargs: dict) -> str:
    """The per-position output this forward must return for the whole prompt ('' when none)."""
    config = getattr(module, "config", None)
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name, getattr(config, name, False)):
            return name
    return ""


def _start_request(module, state: ReuseState, cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict):
    start_time = time.perf_counter()
    prompt_len = input_ids.shape[-1]
    stats = ReuseStats(prompt_tokens=prompt_len, recomputed_tokens=prompt_len)
    cache.stats = stats
    cache.request = request = _Request(prompt_tokens=prompt_len)
    if cache.store is None:  # e.g. a prompt cache built with a direct forward: use the enabled store
        cache.store = state.store
    reason = _refusal(cache, kwargs, input_ids)
    if reason:
        stats.reason = reason
        stats.layer_tokens = [prompt_len] * len(cache.layers)
        cache.untrack()
        return
    try:
        request.namespace = namespace(module)
    except UnfingerprintableModel as err:
        stats.reason = f"model weights cannot be fingerprinted: {err}"
        stats.layer_tokens = [prompt_len] * len(cache.layers)
        cache.untrack()
        return
    if input_ids.shape[0] > 1:
        request.commit_limit = cache.num_tokens + prompt_len
    reused = exact = 0
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    can_skip = isinstance(logits_to_keep, int) and logits_to_keep > 0 and kwargs.get("labels") is None
    per_position = _per_position_outputs(module, kwargs)
    if cache.num_tokens:
        if _can_continue(module, cache, input_ids, kwargs):
            _continue_prefix(cache, input_ids, kwargs)
            stats.lookup_ms = (time.perf_counter() - start_time) * 1000.0
            return
        stats.reason = "continuing a pre-filled cache"
    elif not can_skip:
        stats.reason = "forward needs logits of every position"
    elif per_position:
        stats.reason = f"{per_position}=True returns every prompt position: no reuse (the prompt is still stored)"
    else:
        limit = prompt_len - logits_to_keep
        reused, exact = _load_prefix(cache, request.namespace, input_ids, limit)
        if state.strategy is not None and state.approximate_refusal:
            stats.reason = state.approximate_refusal
        elif state.strategy is not None and exact == reused and reused < limit:
            hits = cache.store.lookup_content(request.namespace, input_ids[0].tolist(), reused, limit)
            if hits:
                _repair(module, state, cache, ReusePlan(input_ids, reused, hits), kwargs, stats, start_time)
                return
        if reused:
            _select_inputs(kwargs, slice(reused, None), prompt_len)
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
        _select_inputs(kwargs, slice(int(positions[0]) if positions.numel() else prompt_len, None), prompt_len)
    else:
        if kwargs.get("position_ids") is None:  # scattered queries cannot infer positions from the cache
            kwargs["position_ids"] = torch.arange(prompt_len, device=input_ids.device).expand(input_ids.shape[0], -1)
        _select_inputs(kwargs, positions, prompt_len)
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


def _is_later_prefill_chunk(cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """A forward of several prompt tokens of which only the last logits are kept (chunked prefill)."""
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    return (cache.stats is not None and input_ids.dim() == 2 and isinstance(logits_to_keep, int)
            and 0 < logits_to_keep < input_ids.shape[1])


def _can_continue(module, cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether this forward extends a cache of exact K/V with prompt tokens the store may hold
    (chunked prefill's later chunks, a continued prompt cache): never decode steps or verifications."""
    request, logits_to_keep = cache.request, kwargs.get("logits_to_keep", 0)
    return (
        request is not None and request.namespace is not None and cache.trackable and cache.store is not None
        and not cache.blending and input_ids.dim() == 2 and input_ids.shape[0] == 1
        and isinstance(logits_to_keep, int) and 0 < logits_to_keep < input_ids.shape[1]
        and kwargs.get("labels") is None and not _per_position_outputs(module, kwargs)
        and (request.commit_limit is None or request.commit_limit >= cache.num_tokens)
        and cache.num_tokens > 0 and cache.get_seq_length() == cache.num_tokens
        and not _refusal(cache, kwargs, input_ids)
    )


def _continue_prefix(cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> None:
    """Load stored K/V of the tokens of ``input_ids`` that extend the cache's tokens, trim them from
    the forward, and add this forward's prompt tokens to the request's stats."""
    have, new = cache.num_tokens, input_ids.shape[1]
    ids = cache.token_ids() + input_ids[0].tolist()
    hits = cache.store.lookup(cache.request.namespace, ids, max_tokens=have + new - kwargs["logits_to_keep"])
    loaded = exact = 0
    for hit in hits:
        skip = max(0, have - hit.start)
        if skip >= hit.num_tokens:
            continue
        for i, layer in enumerate(cache.layers):
            k, v = hit.chunk.layer_states(i, hit.num_tokens)
            layer.append(as_batch(k[:, skip:], 1, input_ids.device), as_batch(v[:, skip:], 1, input_ids.device))
        loaded += hit.num_tokens - skip
        exact += max(0, hit.exact_tokens - skip)
    if loaded:
        cache.track(input_ids[0, :loaded])
        _select_inputs(kwargs, slice(loaded, None), new)
    cache.track(input_ids[0, loaded:])
    stats = cache.stats
    if stats is not None:
        stats.reused_tokens += loaded
        stats.exact_tokens += exact
        stats.approximate_tokens += loaded - exact
        stats.recomputed_tokens -= loaded
        stats.layer_tokens = [stats.recomputed_tokens] * len(cache.layers)


def _load_prefix(cache: ChunkReuseCache, namespace: Key, input_ids: torch.Tensor, max_tokens: int) -> tuple[int, int]:
    """Load the longest stored prefix of the prompt into the empty cache; returns (reused, exact) token counts."""
    row = input_ids[0]
    hits = cache.store.lookup(namespace, row.tolist(), max_tokens=max_tokens)
    reused = sum(hit.num_tokens for hit in hits)
    if not reused:
        return 0, 0
    batch, device = input_ids.shape[0], input_ids.device
    per_layer = []
    for i in range(len(cache.layers)):
        states = [h.chunk.layer_states(i, h.num_tokens) for h in hits]
        per_layer.append([(as_batch(k, batch, device), as_batch(v, batch, device)) for k, v in states])
    cache.load(per_layer, row[:reused])
    return reused, sum(h.exact_tokens for h in hits)


_SEQUENCE_KWARGS = ("position_ids", "token_type_ids")


def _select_inputs(kwargs: dict, index: slice | torch.Tensor, prompt_len: int) -> None:
    """Keep only the prompt tokens at ``index`` (a slice, or sorted positions) in the per-token
    inputs of the real forward; the 2D attention mask stays full length."""
    kwargs["input_ids"] = kwargs["input_ids"][:, index]
    for name in _SEQUENCE_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_len:
            kwargs[name] = value[..., index]
