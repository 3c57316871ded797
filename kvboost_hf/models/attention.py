"""SDPA with position-aware masks, for forwards whose queries are scattered positions.

CacheBlend-style repair runs a forward over a *subset* of prompt positions against a cache
that holds every position in order. transformers builds masks from index ranges, so it is told
the real query positions here: ``kvboost_sdpa`` is the stock SDPA kernel registered under its
own name (``AttentionInterface``) together with a mask function (``AttentionMaskInterface``;
registering only the attention function leaves the mask ``None`` and SDPA silently truncates
keys). Outside a scattered forward the mask function is exactly ``sdpa_mask``; outside a routed
forward (a packed batch, a row-exact verification) the attention function is exactly SDPA.

Attention layers of a model whose numerics kvboost_hf owns (an int4 model on our kernels, a
self-draft) may compute attention their own way (:func:`own_attention`, an :class:`OwnedAttention`):
kvboost_hf's C++ kernel (``kernels.attention.KernelAttention``: each row computed alone, so one call
verifies many rows exactly), or, without the kernels, SDPA in float32 (:class:`Float32SDPA`): on CPU
(torch 2.13), bf16 SDPA for a single query row, a decode step, takes a path 3-4x slower than casting to
float32 and back (184 against 64 us over 209 keys, Gemma-3-270M's heads), while for more rows the two
cost about the same (9 rows: 96 against 126 us; a 256-token prefill: ~3 ms either way). Every call of
a marked layer goes the same way, whatever its rows, so that a prompt's numerics do not depend on how
it is chunked (a batch row equals the request alone). Every SDPA call of kvboost_hf goes through
:func:`sdpa_forward`, so routed, packed and plain forwards agree.

Scattered queries and routes are per thread. The model's config, which every thread shares,
is switched to ``kvboost_sdpa`` once, by :func:`use_kvboost_sdpa`, and never back per request:
a request that restored ``"sdpa"`` while another thread was mid-forward made that forward run
unrouted (not row-exact).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "kvboost_sdpa"
OWNED_ATTR = "kvboost_attention"  # on a model and its attention layers: the OwnedAttention they run
SDPA_IMPLEMENTATIONS = ("sdpa", ATTENTION_NAME)  # stock SDPA, and ours (the same kernel)

logger = logging.getLogger(__name__)
_switch_lock = threading.Lock()


@dataclass
class ScatteredQueries:
    """Positions of the queries of the current forward, and the (positional) key length."""

    positions: torch.Tensor
    kv_length: int


_local = threading.local()


def set_scattered_queries(queries: ScatteredQueries | None) -> None:
    """Declare (or clear) the scattered query positions of this thread's next forward."""
    _local.queries = queries


def scattered_queries() -> ScatteredQueries | None:
    return getattr(_local, "queries", None)


def set_attention_route(function) -> None:
    """Route (or, with None, stop routing) this thread's ``kvboost_sdpa`` calls to ``function``: a packed
    batch forward (:mod:`kvboost_hf.batching.packed`) or a row-exact verification forward
    (:mod:`kvboost_hf.speculative.exact_rows`)."""
    _local.route = function


def attention_route():
    return getattr(_local, "route", None)


DECODE_EXACT = "kvboost_decode_exact"  # on a route: each row is computed as its own decode step computes it


def route_is_decode_exact(route) -> bool:
    """Whether ``route`` (:func:`attention_route`) is none, or computes every row as a decode step does (a row-exact
    verification): then a layer whose own attention computes rows alone gives the same bits routed or not."""
    return route is None or getattr(route, DECODE_EXACT, False)


def kvboost_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """:func:`sdpa_forward`, except inside a routed forward on this thread."""
    route = attention_route()
    if route is not None:
        return route(module, query, key, value, attention_mask, **kwargs)
    return sdpa_forward(module, query, key, value, attention_mask, **kwargs)


def sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA forward, or the layer's own attention where :func:`own_attention` gave it one
    that applies to ``query`` (a marked model moved to a GPU keeps torch's kernels there)."""
    owned = owned_attention(module, query)
    if owned is not None:
        return owned(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class OwnedAttention(Protocol):
    """How the attention layers of a model whose numerics kvboost_hf owns compute (instead of stock SDPA).

    Called like a transformers attention function (``module, query, key, value, attention_mask,
    **kwargs`` -> ``(output [B, M, H, D], None)``) wherever it :meth:`applies`. ``name`` goes into the
    store namespace: K/V computed one way never serve a model computing another way."""

    name: str

    def applies(self, query: torch.Tensor) -> bool: ...

    def __call__(self, module, query, key, value, attention_mask, **kwargs) -> tuple[torch.Tensor, None]: ...

    def decode_rows(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    window: int | None, scaling: float | None, **kwargs) -> torch.Tensor | None:
        """``query``'s rows (the last rows of ``key``), each exactly as its own one-row decode step computes
        it (over the whole past, or the last ``window`` keys), in one call; None where this attention
        cannot (the caller then makes one call per row). ``kwargs``: the layer's other attention arguments."""
        ...


@dataclass(frozen=True)
class Float32SDPA:
    """Stock SDPA on float32 copies of reduced-precision CPU inputs, the output cast back."""

    name: str = "sdpa-float32"

    def applies(self, query: torch.Tensor) -> bool:
        return query.dtype != torch.float32 and query.device.type == "cpu"

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              float32_mask(attention_mask), **kwargs)
        return out.to(query.dtype), weights

    def decode_rows(self, module, query, key, value, *, window, scaling, **kwargs):
        return None  # SDPA's bits depend on the row count: one call per row (speculative.exact_rows)


FLOAT32_SDPA = Float32SDPA()


def owned_attention(module, query: torch.Tensor | None = None) -> OwnedAttention | None:
    """The attention :func:`own_attention` gave ``module`` (None if none; with ``query``, None where it
    does not apply to it)."""
    owned = getattr(module, OWNED_ATTR, None)
    return owned if owned is not None and (query is None or owned.applies(query)) else None


def float32_inputs(module, query, key, value):
    """``(query, key, value, dtype)``: cast to float32 with the dtype to cast the output back to, where the
    layer runs :class:`Float32SDPA` on ``query``; else as given with ``None``. A caller making several calls
    over slices of one key/value (row-exact verification) casts once; the bits are the same if each call
    gets its slice contiguous, as a cast slice would be. A float mask goes through :func:`float32_mask`."""
    if not isinstance(owned_attention(module, query), Float32SDPA):
        return query, key, value, None
    return query.float(), key.float(), value.float(), query.dtype


def float32_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask for float32 inputs: a float mask cast, a boolean one (or None) as it is."""
    return mask.float() if mask is not None and mask.is_floating_point() else mask


def own_attention(model: nn.Module, owned: OwnedAttention) -> bool:
    """Make ``model``'s attention layers compute with ``owned`` (switching it to ``kvboost_sdpa``); returns
    whether they do. For models whose numerics kvboost_hf owns only: it changes a model's outputs in the
    last bits, and stock models promise identity with plain ``generate``. Eager, flash and other
    implementations, and models without ``*Attention`` modules, are left alone (False). Call it before the
    model serves: a forward running meanwhile may see some layers marked and others not."""
    if getattr(model, OWNED_ATTR, None) == owned:
        return use_kvboost_sdpa(model)  # False if its attention was switched to another implementation since
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not layers or not use_kvboost_sdpa(model):
        return False
    for layer in layers:
        setattr(layer, OWNED_ATTR, owned)
    setattr(model, OWNED_ATTR, owned)
    logger.info("%s computes attention with %s (%d layers)", type(model).__name__, owned.name, len(layers))
    return True


def attention_in_float32(model: nn.Module) -> bool:
    """:func:`own_attention` with :class:`Float32SDPA`: the way without kvboost_hf's kernels."""
    return own_attention(model, FLOAT32_SDPA)


def layer_window(module, sliding_window: int | None) -> int | None:
    """The sliding window an attention layer applies (None for a full-attention layer)."""
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    return window if getattr(module, "is_sliding", window is not None) else None


def decode_step_mask(window: int | None, keys: int, device: torch.device) -> torch.Tensor | None:
    """The mask transformers passes to SDPA for a one-token decode step over ``keys`` keys: none,
    unless a sliding layer's keys fill its window (``_ignore_causal_mask_sdpa`` does not skip
    ``kv_length >= local_attention_size``); then an all-True boolean mask. SDPA with a mask rounds
    differently from SDPA without one (~1e-5 in an attention output), so a forward that must match
    decode steps bit for bit (row-exact verification, a packed decoding row) makes the same call."""
    if window is None or keys < window:
        return None
    return torch.ones(1, 1, 1, keys, dtype=torch.bool, device=device)


def position_aware_sdpa_mask(**kwargs):
    """``sdpa_mask``, with query indices mapped to their real positions during a scattered forward."""
    queries = scattered_queries()
    if queries is not None and kwargs["q_length"] == queries.positions.numel() and kwargs["kv_length"] == queries.kv_length:
        positions = queries.positions.to(kwargs.get("device") or queries.positions.device)
        inner = kwargs["mask_function"]

        def remapped(batch_idx, head_idx, q_idx, kv_idx):
            return inner(batch_idx, head_idx, positions[q_idx], kv_idx)

        kwargs.update(mask_function=remapped, q_offset=0, kv_offset=0, allow_is_causal_skip=False, use_vmap=False)
    return sdpa_mask(**kwargs)


def register() -> str:
    """Register ``kvboost_sdpa`` (idempotent); returns its name for ``set_attn_implementation``."""
    AttentionInterface.register(ATTENTION_NAME, kvboost_sdpa_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, position_aware_sdpa_mask)
    return ATTENTION_NAME


def use_kvboost_sdpa(model: nn.Module) -> bool:
    """Name ``kvboost_sdpa`` as ``model``'s attention if it is stock SDPA; returns whether it is
    ``kvboost_sdpa`` now (False for eager, flash and other implementations, which are left alone).

    Idempotent and thread-safe, and meant to stay: outside a routed or scattered forward on the
    calling thread ``kvboost_sdpa`` computes exactly what SDPA computes (or a layer's own attention, given by
    :func:`own_attention`), so forwards on other threads are unaffected and nothing switches
    back per request. The store namespace does not change (the fingerprint files ``kvboost_sdpa`` as
    ``sdpa``), unless :func:`own_attention` marked the model (its attention's ``name``)."""
    config = model.config
    if config._attn_implementation == ATTENTION_NAME:
        return True
    with _switch_lock:
        if config._attn_implementation == "sdpa":
            register()
            config._attn_implementation = ATTENTION_NAME  # the setter recurses into sub-configs
            logger.info("%s now runs attention %r (stock SDPA outside routed forwards)",
                        type(model).__name__, ATTENTION_NAME)
        return config._attn_implementation == ATTENTION_NAME


def attention_implementation(config) -> str | None:
    """The attention implementation a transformers config names (``"sdpa"``, ``"eager"``, ours...)."""
    return getattr(config, "_attn_implementation", None)


def switch(model: nn.Module, name: str) -> str | None:
    """Make ``model`` run attention ``name`` (registering ``kvboost_sdpa`` first if that is it); returns
    the implementation it ran before. The one place besides :func:`use_kvboost_sdpa` that sets it."""
    previous = attention_implementation(model.config)
    if name == ATTENTION_NAME:
        register()
    model.set_attn_implementation(name)
    return previous
