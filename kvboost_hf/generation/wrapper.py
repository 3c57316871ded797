"""``generate`` with chunk reuse: pick or reset the request's cache, call generate, store what it confirmed.

The forward pre-hook in :mod:`kvboost_hf.reuse.hooks` does the lookup inside the call; this module
only decides which :class:`ChunkReuseCache` the call uses (or that it steps aside, and why), runs
the call inside the sessions of the extensions it uses, and commits the confirmed K/V when
generate returns.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from kvboost_hf.cache import ChunkReuseCache, KIVICache, ReuseStats
from kvboost_hf.generation.extension import activate, deactivate, open_sessions
from kvboost_hf.models import attention
from kvboost_hf.reuse import ReuseState, commit_request, reuse_state
from kvboost_hf.store.scope import as_scope

logger = logging.getLogger(__name__)


def generate_with_reuse(model: torch.nn.Module, original, args: tuple, kwargs: dict):
    """Run ``original(*args, **kwargs)`` (the class's own generate) with reuse through ``model``'s store,
    and with the registered extensions (:mod:`kvboost_hf.generation.extension`) that the call uses."""
    state = reuse_state(model)
    inputs = _generate_inputs(args, kwargs)
    if inputs is not None and inputs.dim() == 2 and inputs.shape[1] == 0 and kwargs.get("inputs_embeds") is None:
        # transformers fails deep inside attention with a reshape error; say what is wrong instead.
        raise ValueError("generate() got an empty prompt (0 tokens): pass at least one token, e.g. the BOS token")
    scope = as_scope(kwargs.get("cache_salt"))  # popped after the extensions saw it
    segments = kwargs.pop("segments", None)
    kv_bits = kwargs.pop("kv_bits", None)
    if kv_bits is not None:
        if kwargs.get("past_key_values") is not None:
            raise ValueError("kv_bits builds the request's cache (a KIVICache): do not pass past_key_values as well")
        kwargs["past_key_values"] = KIVICache(model.config, bits=kv_bits)
    sessions = open_sessions(model, kwargs, inputs) if state is not None else ()
    kwargs.pop("cache_salt", None)
    cache = None
    if state is not None:
        cache, reason = _request_cache(model, state, inputs, kwargs)
        if cache is None and reason:
            prompt = int(inputs.shape[-1]) if inputs is not None and inputs.dim() == 2 else 0
            state.last_stats = ReuseStats(prompt_tokens=prompt, recomputed_tokens=prompt, reason=reason)
    if cache is not None:
        cache.scope = scope
        if segments is not None:
            cache.segments = [int(p) for p in segments]
    token = activate(sessions)
    try:
        with contextlib.ExitStack() as stack:
            for session in sessions:
                stack.enter_context(session.around())
            output = original(*args, **kwargs)
    finally:
        deactivate(token)
        attention.set_scattered_queries(None)
        if cache is not None:
            cache.end_blend()
    if sessions:
        stats = cache.stats if cache is not None and cache.stats is not None else state.last_stats
        for session in sessions:
            session.finish(output, stats)
    if cache is not None:
        commit_request(state, cache)
    return output


def _generate_inputs(args: tuple, kwargs: dict) -> torch.Tensor | None:
    inputs = kwargs.get("input_ids", kwargs.get("inputs"))
    if inputs is None and args:
        inputs = args[0]
    return inputs if isinstance(inputs, torch.Tensor) else None


def _request_cache(model, state: ReuseState, inputs, kwargs: dict) -> tuple[ChunkReuseCache | None, str]:
    """The ChunkReuseCache this call uses (created or reset here), or ``(None, why)`` to step aside."""
    config = kwargs.get("generation_config") or model.generation_config
    if getattr(config, "is_assistant", False):
        return None, ""  # an assistant's rounds continue one cache; never reset it (and not a user call)
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return None, "use_cache=False: no cache, no reuse"
    implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if implementation is not None:
        return None, f"cache_implementation={implementation!r}: that cache is used as is, no reuse"
    if not model._supports_default_dynamic_cache():
        return None, f"{type(model).__name__} does not use a DynamicCache: no reuse"
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = ChunkReuseCache(model.config, state.store)
        kwargs["past_key_values"] = cache
        return cache, ""
    if isinstance(cache, KIVICache):
        return None, (f"kv_bits={cache.bits}: approximate live K/V; the store (exact K/V only) is neither read "
                      "nor fed")
    if not isinstance(cache, ChunkReuseCache):
        # The caller's own cache: transformers' semantics, untouched.
        return None, f"past_key_values is a {type(cache).__name__}: used as is, no reuse"
    if cache.store is None:
        cache.store = state.store
    if cache.num_tokens and _continues(cache, inputs):
        cache.request, cache.stats = None, None  # HF's "continue from a prompt cache" pattern
    elif cache.num_tokens or cache.get_seq_length() or cache.request is not None:
        logger.debug("ChunkReuseCache reused for a new prompt: reset (the store keeps the reusable K/V)")
        cache.reset()
    return cache, ""


def _continues(cache: ChunkReuseCache, inputs: torch.Tensor | None) -> bool:
    """Whether ``inputs`` (batch 1) extends exactly the tokens the cache holds."""
    if inputs is None or inputs.dim() != 2 or inputs.shape[0] != 1 or not cache.trackable:
        return False
    n = cache.num_tokens
    if inputs.shape[1] <= n or cache.get_seq_length() != n:
        return False
    return inputs[0, :n].tolist() == cache.token_ids()
