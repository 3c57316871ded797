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

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import ChunkReuseCache, _Request
from .store import ChunkStore
from .store.keys import Key, model_namespace, model_state_token
from .store.codec import ENTRY_OVERHEAD_BYTES
from .telemetry import ReuseStats

logger = logging.getLogger(__name__)

_STATE_ATTR = "_kvboost_reuse"


@dataclass
class _ReuseState:
    store: ChunkStore
    hook: Any = None
    last_stats: ReuseStats | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    _namespace_token: tuple | None = None
    _namespace: Key | None = None

    def namespace(self, model: torch.nn.Module) -> Key:
        token = model_state_token(model)
        with self.lock:
            if token != self._namespace_token:
                self._namespace = model_namespace(model)
                self._namespace_token = token
            return self._namespace


def _target(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose forward generate calls (unwraps peft models)."""
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


def enable_chunk_reuse(model: torch.nn.Module, store: ChunkStore) -> torch.nn.Module:
    """Make ``model.generate`` reuse K/V across requests through ``store``. Idempotent.

    Calling it again with another store switches the store. Returns ``model``.
    Raises ``ValueError`` when ``store`` cannot hold a single chunk of this model's K/V.
    """
    if not isinstance(store, ChunkStore):
        raise TypeError(f"store must be a ChunkStore, got {type(store).__name__}")
    target = _target(model)
    store.check_model(_head_dim(target))
    chunk_bytes = store.chunk_size * kv_bytes_per_token(target) + ENTRY_OVERHEAD_BYTES
    if chunk_bytes > store.max_bytes:
        raise ValueError(
            f"ChunkStore(max_bytes={store.max_bytes}) cannot hold one {store.chunk_size}-token chunk of this "
            f"model's K/V ({chunk_bytes} bytes): raise max_bytes or lower chunk_size"
        )
    state = getattr(target, _STATE_ATTR, None)
    if state is not None:
        state.store = store
        return model
    state = _ReuseState(store=store)
    state.hook = target.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    target.generate = _wrap_generate(target, target.generate)
    setattr(target, _STATE_ATTR, state)
    return model


def disable_chunk_reuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_chunk_reuse` (the store keeps its entries). Returns ``model``."""
    target = _target(model)
    state = getattr(target, _STATE_ATTR, None)
    if state is not None:
        state.hook.remove()
        target.__dict__.pop("generate", None)
        delattr(target, _STATE_ATTR)
    return model


def is_chunk_reuse_enabled(model: torch.nn.Module) -> bool:
    return getattr(_target(model), _STATE_ATTR, None) is not None


def last_request_stats(model: torch.nn.Module) -> ReuseStats | None:
    """Reuse statistics of the latest generate call (or ``warm``) on ``model``; None before any."""
    state = getattr(_target(model), _STATE_ATTR, None)
    return None if state is None else state.last_stats


# ---------------------------------------------------------------------- generate wrapper
def _wrap_generate(model: torch.nn.Module, original):
    @functools.wraps(original)
    def generate(*args, **kwargs):
        state = getattr(model, _STATE_ATTR, None)
        inputs = _generate_inputs(args, kwargs)
        if inputs is not None and inputs.dim() == 2 and inputs.shape[1] == 0 and kwargs.get("inputs_embeds") is None:
            # transformers fails deep inside attention with a reshape error; say what is wrong instead.
            raise ValueError("generate() got an empty prompt (0 tokens): pass at least one token, e.g. the BOS token")
        cache = _request_cache(model, state, inputs, kwargs) if state is not None else None
        output = original(*args, **kwargs)
        if cache is not None:
            _finish_request(state, cache)
        return output

    return generate


def _finish_request(state: _ReuseState, cache: ChunkReuseCache, pin: bool = False) -> None:
    stored = cache.commit(pin=pin)
    if cache.stats is not None:
        cache.stats.stored_chunks = stored
        state.last_stats = cache.stats


def _generate_inputs(args: tuple, kwargs: dict) -> torch.Tensor | None:
    inputs = kwargs.get("input_ids", kwargs.get("inputs"))
    if inputs is None and args:
        inputs = args[0]
    return inputs if isinstance(inputs, torch.Tensor) else None


def _request_cache(model, state: _ReuseState, inputs: torch.Tensor | None, kwargs: dict) -> ChunkReuseCache | None:
    """The ChunkReuseCache this generate call will use (created or reset here), or None to stay out."""
    config = kwargs.get("generation_config") or model.generation_config
    if getattr(config, "is_assistant", False):
        return None  # an assistant's rounds continue one cache; never reset it
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return None
    if kwargs.get("cache_implementation", getattr(config, "cache_implementation", None)) is not None:
        return None
    if not model._supports_default_dynamic_cache():
        return None
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = ChunkReuseCache(model.config, state.store)
        kwargs["past_key_values"] = cache
        return cache
    if not isinstance(cache, ChunkReuseCache):
        return None  # the caller's own cache: transformers' semantics, untouched
    if cache.store is None:
        cache.store = state.store
    if cache.num_tokens and _continues(cache, inputs):
        cache.request, cache.stats = None, None  # HF's "continue from a prompt cache" pattern
    elif cache.num_tokens or cache.get_seq_length() or cache.request is not None:
        logger.debug("ChunkReuseCache reused for a new prompt: reset (the store keeps the reusable K/V)")
        cache.reset()
    return cache


def _continues(cache: ChunkReuseCache, inputs: torch.Tensor | None) -> bool:
    """Whether ``inputs`` (batch 1) extends exactly the tokens the cache holds."""
    if inputs is None or inputs.dim() != 2 or inputs.shape[0] != 1 or not cache.trackable:
        return False
    n = cache.num_tokens
    if inputs.shape[1] <= n or cache.get_seq_length() != n:
        return False
    return inputs[0, :n].tolist() == cache.token_ids()


# ---------------------------------------------------------------------- forward pre-hook
def _pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, ChunkReuseCache):
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
        state = getattr(module, _STATE_ATTR, None)
        if state is not None:
            _start_request(module, state, cache, input_ids, kwargs)
            return args, kwargs
    if cache.trackable:
        cache.track(input_ids[0])
    return args, kwargs


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


def _start_request(module, state: _ReuseState, cache: ChunkReuseCache, input_ids: torch.Tensor, kwargs: dict):
    start_time = time.perf_counter()
    prompt_len = input_ids.shape[-1]
    stats = ReuseStats(prompt_tokens=prompt_len, recomputed_tokens=prompt_len)
    cache.stats = stats
    cache.request = request = _Request(prompt_tokens=prompt_len)
    reason = _refusal(cache, kwargs, input_ids)
    if reason:
        stats.reason = reason
        cache.untrack()
        return
    request.namespace = state.namespace(module)
    if input_ids.shape[0] > 1:
        request.commit_limit = cache.num_tokens + prompt_len
    reused = exact = 0
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    can_skip = isinstance(logits_to_keep, int) and logits_to_keep > 0 and kwargs.get("labels") is None
    if cache.num_tokens:
        stats.reason = "continuing a pre-filled cache"
    elif not can_skip:
        stats.reason = "forward needs logits of every position"
    else:
        reused, exact = _load_prefix(cache, request.namespace, input_ids, prompt_len - logits_to_keep)
        if reused:
            _trim_inputs(kwargs, reused, prompt_len)
    cache.track(input_ids[0, reused:])
    stats.reused_tokens, stats.exact_tokens, stats.approximate_tokens = reused, exact, reused - exact
    stats.recomputed_tokens = prompt_len - reused
    stats.lookup_ms = (time.perf_counter() - start_time) * 1000.0


def _load_prefix(cache: ChunkReuseCache, namespace: Key, input_ids: torch.Tensor, max_tokens: int) -> tuple[int, int]:
    """Load the longest stored prefix of the prompt into the empty cache; returns (reused, exact) token counts."""
    row = input_ids[0]
    hits = cache.store.lookup(namespace, row.tolist(), max_tokens=max_tokens)
    reused = sum(hit.num_tokens for hit in hits)
    if not reused:
        return 0, 0
    batch, device = input_ids.shape[0], input_ids.device

    def segment(tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.unsqueeze(0)
        if t.device != device:
            t = t.to(device, non_blocking=True)
        return t.expand(batch, -1, -1, -1) if batch > 1 else t

    per_layer = []
    for i in range(len(cache.layers)):
        states = [h.chunk.layer_states(i, h.num_tokens) for h in hits]
        per_layer.append([(segment(k), segment(v)) for k, v in states])
    cache.load(per_layer, row[:reused])
    return reused, sum(h.exact_tokens for h in hits)


_SEQUENCE_KWARGS = ("position_ids", "token_type_ids")


def _trim_inputs(kwargs: dict, reused: int, prompt_len: int) -> None:
    """Slice the per-token inputs so only tokens after ``reused`` run; the 2D mask stays full."""
    kwargs["input_ids"] = kwargs["input_ids"][:, reused:]
    for name in _SEQUENCE_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_len:
            kwargs[name] = value[..., reused:]


# ---------------------------------------------------------------------- warm
def warm(
    model: torch.nn.Module,
    input_ids_or_text: str | Sequence[int] | torch.Tensor,
    store: ChunkStore,
    tokenizer=None,
    pin: bool = False,
) -> ReuseStats:
    """Prefill ``store`` with the K/V of a text or token sequence (one forward, no generation).

    Text is tokenized with ``tokenizer`` exactly as a prompt would be (special tokens added),
    so a warmed system prompt is a prefix of later prompts that start with it. ``pin=True``
    makes the store evict these chunks last.
    """
    target = _target(model)
    if isinstance(input_ids_or_text, str):
        if tokenizer is None:
            raise ValueError("warm() got text: pass tokenizer= to tokenize it, or pass token ids")
        ids = tokenizer(input_ids_or_text, return_tensors="pt")["input_ids"]
    else:
        ids = torch.as_tensor(input_ids_or_text, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"warm() needs one non-empty token sequence, got shape {tuple(ids.shape)}")
    ids = ids.to(target.device)
    installed_here = not is_chunk_reuse_enabled(target)
    if installed_here:
        enable_chunk_reuse(target, store)
    try:
        state = getattr(target, _STATE_ATTR)
        cache = ChunkReuseCache(target.config, store)
        with torch.no_grad():
            target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _finish_request(state, cache, pin=pin)
    finally:
        if installed_here:
            disable_chunk_reuse(target)
    return cache.stats
