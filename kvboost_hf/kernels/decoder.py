"""``fuse_decoder``: a decoder whose layers are all fused runs them as one loop of op calls.

A fused layer (:mod:`.layer`) still goes through transformers' plumbing on every call: the decoder builds
causal and sliding masks, calls each layer module with a dozen keyword arguments, and the layer dispatches
attention through ``ALL_ATTENTION_FUNCTIONS`` and kvboost_hf's route. For an int4 model on our kernels
that is ~1 ms of a decode step's ~7 ms of decoder (Gemma-3-270M, 2 cores, the interpreter's objects
evicted by the step's weights as in a real step). Where a call is a plain one, a fused decoder skips it:
per layer, the two layer ops, the cache's ``update`` and the attention kernel, nothing else.

Exact: a plain call is one whose masks say nothing the kernel does not know already. kvboost_hf's attention
kernel computes each query row alone over the keys it may read, skipping the others, so reading the keys
up to the row's position (the last ``sliding_window`` of them on a sliding layer) gives the bits that the
same keys selected by transformers' mask give (``csrc/attention_body.inc``). So the fast loop is taken only
where every one of these holds, checked on every call, and otherwise the decoder's own forward runs:

- every layer is fused and :func:`~.layer.cached_arguments` reproduces it; no layer has hooks or is training;
  every attention layer computes on :class:`~.attention.KernelAttention` (the model's implementation is
  ``kvboost_sdpa``), with no route but a decode-exact one and no scattered queries on this thread;
- the cache is one whose layers return every key in order (transformers' dynamic layers, or a class that
  says so with :data:`~.plan.KEYS_IN_ORDER`), never a static or quantized one;
- the positions are the cache's next ones, the padding mask (if any) is all ones and 2-D;
- nothing asks for hidden states, attentions, a tuple, or anything else this loop does not give.

A decoder fused with a ``fresh_layer`` (the AWQ loader and ``make_draft`` give kvboost_hf's in-place layers) also
swaps, at a plain call on a cache whose layers hold nothing yet (``generate``'s new ``DynamicCache``), each layer for
the one ``fresh_layer`` makes: the same keys and values, appended in place instead of concatenated, so a decode
step does not copy the whole history (Gemma-3-270M's 18 updates, benchmarks/cache_update.py: 1.12 -> 0.81 ms at
200 tokens, 2.23 -> 0.74 ms at 2000, of a ~37 ms step on 2 cores).

The in-place protocol: where a cache layer's own class defines ``kvboost_reserve(shape, dtype)`` (the new states'
``[batch, kv_heads, rows, head_dim]`` and dtype) and ``kvboost_commit(keys, values)``, and the cache's ``update`` is
its layers' (transformers' own, or a cache class's own ``kvboost_updates_layers_only()`` says so for this call), a
layer is one ``torch.ops.kvboost.layer_step`` call: reserve gives the layer's key and value buffers, the first key
its update would return and where the new rows go (or None: update takes them this time), the op writes the new
states there and attends over them, and commit leaves the layer as its update would have. The same functions in the
same order as the four calls it replaces: the same bits, one call instead of four and no cache update in Python
(kvboost_hf's in-place layers, ``kvboost_hf.cache.buffer``, implement it). Where every layer reserves, the whole
forward is one ``torch.ops.kvboost.decoder_step`` call: every layer reserved first, then each layer's ``layer_step``
in order inside it (through the dispatcher; the layers' arguments as flat lists the plan keeps), then each layer
committed: the same calls without the interpreter between them (Gemma-3-270M
int4, 2 cores: decoder 7.25 -> 5.82 ms, benchmarks/decoder_ab.py). Where a layer does not reserve, each layer is
one ``layer_step`` call or the four calls, as it takes them. Each class on the way that defines
``update`` binds ``kvboost_update = update`` next to it: an ``update`` patched on such a class, on transformers'
``Cache``, or set on a cache or layer instance is not one the protocol mirrors, so those calls run it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_outputs import BaseModelOutputWithPast

from kvboost_hf.kernels.layer import as_own_class, global_hooks, mix_in, mix_out
from kvboost_hf.kernels.plan import DECODER_FORMS, WITNESS_ATTR, Plan, held_or_new_plan
from kvboost_hf.kernels.rotary import BLOCKS_ATTR, rotary_rows
from kvboost_hf.models import attention

logger = logging.getLogger(__name__)

FALLBACKS = "kvboost_fallbacks"  # a fused decoder's attribute: the fallback reasons logged (_log_fallback)
FRESH_LAYER = "kvboost_fresh_layer"  # a fused decoder's attribute: fuse_decoder's fresh_layer
RESERVE = "kvboost_reserve"  # the in-place protocol's method, defined by a cache layer's own class (module docstring)
UPDATES_LAYERS_ONLY = "kvboost_updates_layers_only"  # ... and a cache class's own method saying its update adds nothing
MIRRORED = "kvboost_update"  # ... and, in each class defining update, the update its protocol methods mirror
_CACHE_UPDATE = Cache.update  # as imported: a later patch of it is a cache update the protocol does not mirror
FreshLayer = Callable[[CacheLayerMixin], "CacheLayerMixin | None"]


_PLAIN_KWARGS = frozenset({"cache_position", "output_attentions", "output_hidden_states", "return_dict"})
_DTYPES = (torch.bfloat16, torch.float32)


class KernelDecoderMixin:
    """The forward of a fused decoder (mixed into the decoder's own class by :func:`fuse_decoder`)."""

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, **kwargs):
        hidden = self._fast_loop(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, kwargs)
        if isinstance(hidden, str):
            _log_fallback(self, hidden)
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)

    def _fast_loop(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, kwargs: dict):
        """The last layer's output for a plain call, or (before any module ran) why the call is not one."""
        if (input_ids is None) == (inputs_embeds is None) or cache is None:
            return "no cache, or not exactly one of input_ids and inputs_embeds"
        if not _plain(self, kwargs):
            return "the call or the model asks for more (outputs, training, hooks, another attention, compiling)"
        plan = held_or_new_plan(self, cache)
        if plan is None:
            return f"a layer or the cache ({type(cache).__name__}) is not one the fused loop reproduces"
        rows = input_ids if inputs_embeds is None else inputs_embeds
        dtype = self.embed_tokens.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
        positions = _next_positions(rows, attention_mask, position_ids, cache)
        grad = self.embed_tokens.weight.requires_grad if inputs_embeds is None else inputs_embeds.requires_grad
        if positions is None:
            return "the positions are not the cache's next ones, or the mask is not a 2-D mask of ones"
        if rows.dim() != (2 if inputs_embeds is None else 3) or not rows.is_cpu:
            return f"inputs of shape {tuple(rows.shape)} on {rows.device}"
        if dtype not in _DTYPES:
            return f"{dtype} (the fused ops take bfloat16 or float32: choose it at load, from_pretrained(dtype=...))"
        if torch.is_grad_enabled() and grad:
            return "gradients are enabled and the inputs require them"
        if any(a.has_bias and a.bias_dtypes != {dtype} for a, *_ in plan.layers):
            return f"a projection's bias is not {dtype}"
        # Checked before any module runs; what follows falls back only for an embedding or rotary module of another
        # kind than the decoder's (another output dtype or size), whose calls transformers' forward then repeats.
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if hidden.dtype != dtype or hidden.dim() != 3:
            return f"the embedding gives {hidden.dtype} of {hidden.dim()} dimensions"
        embeddings = _position_embeddings(self, hidden, positions, plan)
        if embeddings is None:
            return "the rotary module's cos/sin are not the layers' dtype and head size"
        fresh = self.__dict__.get(FRESH_LAYER)
        if fresh is not None:
            _swap_fresh_layers(cache, fresh)
        cache_layers = cache.layers if _updates_layers_only(cache) else None
        batch, rows = hidden.shape[:2]
        if cache_layers is not None:  # the in-place protocol (module docstring): one op call for the decoder
            slots = _reserved(cache_layers, plan, batch, rows, hidden.dtype)
            if slots is not None:
                hidden, keys, values = torch.ops.kvboost.decoder_step(
                    hidden, *_decoder_arguments(plan), [c for c, _ in embeddings], [s for _, s in embeddings], *slots)
                for (_, index, *_), k, v in zip(plan.layers, keys, values):
                    cache_layers[index].kvboost_commit(k, v)
                return hidden
        for (arguments, index, head_dim, scaling, window), rope in zip(plan.layers, plan.rope):
            cos, sin = embeddings[rope]
            if cache_layers is not None:  # a layer whose cache layer takes the protocol: one op call for the layer
                layer = cache_layers[index]
                reserve = _reserver(layer)
                slots = reserve and reserve(layer, (batch, arguments.outs[1] // head_dim, rows, head_dim), hidden.dtype)
                if slots:
                    hidden, k, v = torch.ops.kvboost.layer_step(*arguments.step(hidden, cos, sin, head_dim), *slots,
                                                                 scaling, window)
                    layer.kvboost_commit(k, v)
                    continue
            q, k, v = torch.ops.kvboost.layer_attention_inputs(*arguments.inputs(hidden, cos, sin, head_dim))
            k, v = cache.update(k, v, index)
            out = torch.ops.kvboost.attention(q, k, v, None, scaling, True, window)
            hidden = torch.ops.kvboost.layer_output(*arguments.output(hidden, out))
        return hidden

    def __reduce_ex__(self, protocol):
        """Copy and pickle as the decoder's own class (:func:`fuse_decoder` fuses the copy again)."""
        return as_own_class(self, forget=(FRESH_LAYER, FALLBACKS, WITNESS_ATTR, BLOCKS_ATTR))


def _log_fallback(decoder: nn.Module, reason: str) -> None:
    """Say once per decoder and reason (at DEBUG) why a forward ran transformers' loop instead of the fused one."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    seen = decoder.__dict__.setdefault(FALLBACKS, set())
    if reason not in seen:
        seen.add(reason)
        logger.debug("%s ran transformers' forward, not the fused loop: %s", type(decoder).__name__, reason)


def _plain(decoder: nn.Module, kwargs: dict) -> bool:
    """Whether nothing in this call or this thread's state asks for more than the fast loop computes."""
    config = decoder.config
    return (not decoder.training and _PLAIN_KWARGS.issuperset(kwargs)
            and not kwargs.get("output_attentions") and not kwargs.get("output_hidden_states")
            and kwargs.get("return_dict", True) is not False
            and not getattr(config, "output_attentions", False) and not getattr(config, "output_hidden_states", False)
            and getattr(config, "return_dict", True) is not False and getattr(config, "is_causal", True) is not False
            and not getattr(config, "use_bidirectional_attention", False)
            and attention.attention_implementation(config) == attention.ATTENTION_NAME
            and attention.scattered_queries() is None and attention.route_is_decode_exact(attention.attention_route())
            and not torch.compiler.is_compiling()
            and not global_hooks())


def _updates_layers_only(cache: Cache) -> bool:
    """Whether ``cache.update(k, v, i)`` is ``cache.layers[i].update(k, v)`` and nothing more in this call (so the loop
    may append through a layer's in-place protocol), with no autograd recording the forward: transformers' own
    ``Cache.update`` as this module found it (a patch of it, or an ``update`` set on the instance, runs as it is), and
    every class on the way that defines ``update`` mirrors it (:func:`_mirrors`) and says so for this call."""
    if torch.is_grad_enabled() or "update" in cache.__dict__ or getattr(cache, "offloading", False):
        return False
    for cls in type(cache).__mro__:
        own = cls.__dict__
        if cls is Cache:
            return own.get("update") is _CACHE_UPDATE
        if "update" in own and not (_mirrors(own) and UPDATES_LAYERS_ONLY in own and own[UPDATES_LAYERS_ONLY](cache)):
            return False
    return False


def _reserver(layer) -> Callable | None:
    """``layer``'s own class's ``kvboost_reserve``, where every ``update`` its update can run is one the protocol
    mirrors: none set on the instance, and each class of kvboost_hf's or a user's that defines one names it
    (:func:`_mirrors`), down to transformers' layer class (whose update the in-place layers do not call)."""
    cls = type(layer)
    reserve = cls.__dict__.get(RESERVE)
    if reserve is None or "update" in layer.__dict__:
        return None
    for c in cls.__mro__:
        if c.__module__.startswith("transformers."):
            break
        own = c.__dict__
        if "update" in own and not _mirrors(own):
            return None
    return reserve


def _mirrors(own) -> bool:
    """Whether a class's ``update`` is still the one its in-place protocol was written against (``kvboost_update``,
    bound in the class body next to it): a patch of the class's ``update`` breaks that."""
    return own.get(MIRRORED) is own["update"]


def _swap_fresh_layers(cache: Cache, fresh: FreshLayer) -> None:
    """Each layer of ``cache`` that ``fresh`` replaces, replaced; only while the cache holds nothing (a check of its
    first layer). (An offloading cache, which moves its layers' tensors itself, needs CUDA: never on this CPU loop.)"""
    layers = cache.layers
    if not layers or layers[0].is_initialized:
        return
    for i, layer in enumerate(layers):
        new = fresh(layer)
        if new is not None:
            layers[i] = new


def _next_positions(rows: torch.Tensor, mask, positions, cache: Cache) -> torch.Tensor | None:
    """The position ids of the call's rows (``rows``: its input ids or embeddings): the cache's next ones. None
    where the call's positions are other ones or its mask hides a key (then transformers' masks say more than the
    kernel's causal window)."""
    batch, count = rows.shape[:2]
    past = cache.get_seq_length()
    expected = torch.arange(past, past + count, device=rows.device).unsqueeze(0)
    if positions is not None and (positions.shape[-1] != count or positions.dim() > 2
                                  or not torch.equal(positions.expand(batch, count), expected.expand(batch, count))):
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2
                             or mask.shape != (batch, past + count) or not bool(mask.all())):
        return None
    return expected if positions is None else positions


def _position_embeddings(decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, plan: Plan):
    """The ``(cos, sin)`` of each of ``plan.rotary`` as the decoder computes them (layer i takes the
    ``plan.rope[i]``-th), or None where a layer's ops do not take them."""
    kinds = [None] if plan.types is None else plan.rotary  # None: one rotary for every layer, called without a kind
    embeddings = [rotary_rows(decoder, hidden, positions, t)
                  or decoder.rotary_emb(hidden, positions, *(() if t is None else (t,))) for t in kinds]
    for (_, _, head_dim, _, _), rope in zip(plan.layers, plan.rope):
        cos, sin = embeddings[rope]
        if cos.dtype != hidden.dtype or sin.dtype != hidden.dtype or cos.shape[-1] != head_dim:
            return None
    return embeddings


def _reserved(cache_layers, plan: Plan, batch: int, rows: int, dtype: torch.dtype) -> tuple | None:
    """``torch.ops.kvboost.decoder_step``'s key buffers, value buffers, first keys and new rows' positions, one per
    layer, from each cache layer's ``kvboost_reserve``; None where a layer does not take the protocol now, or one
    cache layer object stands at two indices or two layers reserve one buffer (each must see the other's append:
    then every layer runs as the per-layer loop decides; reserving changes nothing a second reserve or update
    sees)."""
    layers = [cache_layers[index] for _, index, *_ in plan.layers]
    if len(set(map(id, layers))) != len(layers):  # one layer object at two indices: each must see the other's append
        return None
    keys, values, firsts, ends = [], [], [], []
    for (arguments, _, head_dim, _, _), layer in zip(plan.layers, layers):
        reserve = _reserver(layer)
        slots = reserve and reserve(layer, (batch, arguments.outs[1] // head_dim, rows, head_dim), dtype)
        if not slots:
            return None
        keys.append(slots[0])
        values.append(slots[1])
        firsts.append(slots[2])
        ends.append(slots[3])
    if len(set(map(id, keys + values))) != 2 * len(keys):  # layers sharing one buffer (a shallow copy of a layer)
        return None
    return keys, values, firsts, ends


def _decoder_arguments(plan: Plan) -> tuple:
    """``torch.ops.kvboost.decoder_step``'s arguments for ``plan``'s layers, from the projections' weights to the
    rotary indices, as flat lists layer after layer (made once per plan, at its first use: the plan's own tensor
    objects, so a tensor swapped or repointed in place is passed as it is at each call)."""
    if plan.fused is None:
        lists = [[] for _ in range(14)]
        for (a, _, head_dim, scale, window), rope in zip(plan.layers, plan.rope):
            q_norm, k_norm, head_eps = a.head_norms or (None, None, 0.0)
            for held, more in zip(lists, (a.qweights, a.sides, a.outs, a.groups, a.biases, a.norms, [a.eps],
                                          [q_norm, k_norm], [head_eps], [head_dim], [a.activation], [scale],
                                          [window], [rope])):
                held.extend(more)
        plan.fused = tuple(lists)
    return plan.fused


def fuse_decoder(model: nn.Module, fresh_layer: FreshLayer | None = None) -> int:
    """Give the decoders in ``model`` that :data:`DECODER_FORMS` knows the fast loop (taken where every layer is
    fused and the call is plain, checked on every call); returns how many. ``fresh_layer``: given a cache layer that
    holds nothing yet, the layer to use in its place (the same keys and values, kept another way) or None to keep
    it; the fast loop applies it to an empty cache's layers (module docstring)."""
    count = mix_in(model, DECODER_FORMS, KernelDecoderMixin)
    for module in model.modules():
        if isinstance(module, KernelDecoderMixin):
            module.__dict__[FRESH_LAYER] = fresh_layer
    return count


def unfuse_decoder(model: nn.Module) -> int:
    """Undo :func:`fuse_decoder`; returns how many decoders changed."""
    return mix_out(model, KernelDecoderMixin, forget=(FRESH_LAYER, WITNESS_ATTR, BLOCKS_ATTR))
