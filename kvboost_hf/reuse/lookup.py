"""Finding and loading a prompt's stored K/V: the exact prefix, and later chunks of a chunked prefill.

Pure helpers of the forward hooks (:mod:`kvboost_hf.reuse.hooks`): they read the store, fill the
request's cache and trim the forward's inputs to the tokens still to compute.
"""

from __future__ import annotations

import torch

from kvboost_hf.cache import ChunkReuseCache
from kvboost_hf.cache.chunk_reuse import as_batch
from kvboost_hf.models.rope import length_dependent_rope
from kvboost_hf.store.keys import Key


def refusal(cache: ChunkReuseCache, kwargs: dict, input_ids: torch.Tensor) -> str:
    """Why this request can neither reuse nor be stored ('' when it can)."""
    if cache.store is None:
        return "cache has no store"
    if not cache.layers:  # not supports_reuse either; said apart, as the fix is the caller's
        return "ChunkReuseCache built without the model's config: pass it (ChunkReuseCache(model.config, store))"
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


def rope_refusal(module: torch.nn.Module) -> str:
    """Why ``module``'s RoPE rules out stored K/V ('' when it does not): under a RoPE whose frequencies depend on a
    forward's longest position (:func:`~kvboost_hf.models.rope.length_dependent_rope`) a key depends on the forward
    that computed it: its length, and in a packed batch the other rows' positions."""
    rope = length_dependent_rope(getattr(module, "config", None))
    return (f"rope_type {rope!r} recomputes its frequencies from each forward's longest position: stored K/V would "
            "depend on the forward that computed them, no reuse") if rope else ""


def per_position_outputs(module: torch.nn.Module, kwargs: dict) -> str:
    """The per-position output this forward must return for the whole prompt ('' when none)."""
    config = getattr(module, "config", None)
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name, getattr(config, name, False)):
            return name
    return ""


def is_later_prefill_chunk(cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """A forward of several prompt tokens of which only the last logits are kept (chunked prefill)."""
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    return (cache.stats is not None and input_ids.dim() == 2 and isinstance(logits_to_keep, int)
            and 0 < logits_to_keep < input_ids.shape[1])


def can_continue(module, cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> bool:
    """Whether this forward extends a cache of exact K/V with prompt tokens the store may hold
    (chunked prefill's later chunks, a continued prompt cache): never decode steps or verifications."""
    request, logits_to_keep = cache.request, kwargs.get("logits_to_keep", 0)
    return (
        request is not None and request.namespace is not None and cache.trackable and cache.store is not None
        and not cache.blending and input_ids.dim() == 2 and input_ids.shape[0] == 1
        and isinstance(logits_to_keep, int) and 0 < logits_to_keep < input_ids.shape[1]
        and kwargs.get("labels") is None and not per_position_outputs(module, kwargs)
        and (request.commit_limit is None or request.commit_limit >= cache.num_tokens)
        and cache.num_tokens > 0 and cache.get_seq_length() == cache.num_tokens
        and not refusal(cache, kwargs, input_ids)
    )


def continue_prefix(cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict) -> None:
    """Load stored K/V of the tokens of ``input_ids`` that extend the cache's tokens, trim them from
    the forward, and add this forward's prompt tokens to the request's stats."""
    have, new = cache.num_tokens, input_ids.shape[1]
    ids = cache.token_ids() + input_ids[0].tolist()
    hits = cache.store.lookup(cache.request.namespace, ids, max_tokens=have + new - kwargs["logits_to_keep"],
                              shared=cache.request.shared)
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
        select_inputs(kwargs, slice(loaded, None), new)
    cache.track(input_ids[0, loaded:])
    stats = cache.stats
    if stats is not None:
        stats.reused_tokens += loaded
        stats.exact_tokens += exact
        stats.approximate_tokens += loaded - exact
        stats.recomputed_tokens -= loaded
        stats.layer_tokens = [stats.recomputed_tokens] * len(cache.layers)


def load_prefix(cache: ChunkReuseCache, namespace: Key, input_ids: torch.Tensor, max_tokens: int) -> tuple[int, int]:
    """Load the longest stored prefix of the prompt into the empty cache; returns (reused, exact) token counts."""
    row = input_ids[0]
    hits = cache.store.lookup(namespace, row.tolist(), max_tokens=max_tokens, shared=cache.request.shared)
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


def select_inputs(kwargs: dict, index: slice | torch.Tensor, prompt_len: int) -> None:
    """Keep only the prompt tokens at ``index`` (a slice, or sorted positions) in the per-token
    inputs of the real forward; the 2D attention mask stays full length."""
    kwargs["input_ids"] = kwargs["input_ids"][:, index]
    for name in _SEQUENCE_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_len:
            kwargs[name] = value[..., index]
