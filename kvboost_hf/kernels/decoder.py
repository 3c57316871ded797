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
  says so with :data:`KEYS_IN_ORDER`), never a static or quantized one;
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
(kvboost_hf's in-place layers, ``kvboost_hf.cache.buffer``, implement it).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain, repeat

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

from kvboost_hf.kernels.attention import KernelAttention
from kvboost_hf.kernels.layer import (
    ABSENT,
    KernelLayerMixin,
    _hooked,
    as_own_class,
    cached_arguments,
    capture_hooks_only,
    mix_in,
    mix_out,
    remembered_sources,
)
from kvboost_hf.models import attention

logger = logging.getLogger(__name__)

KEYS_IN_ORDER = "kvboost_keys_in_order"  # a cache layer class attribute: update() returns every key, in order
FRESH_LAYER = "kvboost_fresh_layer"  # a fused decoder's attribute: fuse_decoder's fresh_layer
WITNESS_ATTR = "_kvboost_plan_witness"  # a fused decoder's attribute: its last plan and what it was read from
RESERVE = "kvboost_reserve"  # the in-place protocol's method, defined by a cache layer's own class (module docstring)
UPDATES_LAYERS_ONLY = "kvboost_updates_layers_only"  # ... and a cache class's own method saying its update adds nothing
FreshLayer = Callable[[CacheLayerMixin], "CacheLayerMixin | None"]


@dataclass(frozen=True)
class DecoderForm:
    """How a decoder class's forward (transformers 5.x) builds its layers' inputs. ``rotary_by_type``: one
    ``rotary_emb(x, position_ids, layer_type)`` call per layer type (Gemma 3), else one ``rotary_emb(x,
    position_ids)`` for every layer. ``windows``: which layers get a sliding-window mask (of the config's
    ``sliding_window``): ``"types"`` those whose ``layer_types`` entry is ``"sliding_attention"``, ``"config"``
    every layer while ``sliding_window`` is set (Mistral), None none."""

    rotary_by_type: bool
    windows: str | None


DECODER_FORMS = {  # decoder classes whose forward was read line by line, with the layer classes of FORMS
    "Gemma3TextModel": DecoderForm(True, "types"),
    "LlamaModel": DecoderForm(False, None),
    "MistralModel": DecoderForm(False, "config"),
    "Qwen2Model": DecoderForm(False, "types"),
    "Qwen3Model": DecoderForm(False, "types"),
}
_PLAIN_KWARGS = frozenset({"cache_position", "output_attentions", "output_hidden_states", "return_dict"})
_DTYPES = (torch.bfloat16, torch.float32)


class KernelDecoderMixin:
    """The forward of a fused decoder (mixed into the decoder's own class by :func:`fuse_decoder`)."""

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, **kwargs):
        hidden = self._fast_loop(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, kwargs)
        if hidden is None:
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=past_key_values)

    def _fast_loop(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, kwargs: dict):
        """The last layer's output for a plain call, or None (before any module ran) where the call is not plain."""
        if (input_ids is None) == (inputs_embeds is None) or cache is None or not _plain(self, kwargs):
            return None
        plan = _held_or_new_plan(self, cache)
        if plan is None:
            return None
        rows = input_ids if inputs_embeds is None else inputs_embeds
        dtype = self.embed_tokens.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
        positions = _next_positions(rows, attention_mask, position_ids, cache)
        grad = self.embed_tokens.weight.requires_grad if inputs_embeds is None else inputs_embeds.requires_grad
        if (positions is None or rows.dim() != (2 if inputs_embeds is None else 3) or not rows.is_cpu
                or dtype not in _DTYPES or torch.is_grad_enabled() and grad
                or any(a.has_bias and a.bias_dtypes != {dtype} for a, *_ in plan.layers)):
            return None
        # Checked before any module runs; what follows falls back only for an embedding or rotary module of another
        # kind than the decoder's (another output dtype or size), whose calls transformers' forward then repeats.
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if hidden.dtype != dtype or hidden.dim() != 3:
            return None
        embeddings = _position_embeddings(self, hidden, positions, plan)
        if embeddings is None:
            return None
        fresh = self.__dict__.get(FRESH_LAYER)
        if fresh is not None:
            _swap_fresh_layers(cache, fresh)
        cache_layers = cache.layers if _updates_layers_only(cache) else None
        batch, rows = hidden.shape[:2]
        for (arguments, index, head_dim, scaling, window), (cos, sin) in zip(plan.layers, embeddings):
            if cache_layers is not None:  # the in-place protocol (module docstring): one op call for the layer
                layer = cache_layers[index]
                reserve = type(layer).__dict__.get(RESERVE)
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
        return as_own_class(self, forget=(FRESH_LAYER, WITNESS_ATTR))


@dataclass
class _Plan:
    layers: list  # (LayerArguments, cache index, head size, scale, window or 0) per layer, in order
    types: list | None  # the layers' types (Gemma 3's rotary per type), else None


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
            and not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks))


_local = threading.local()  # .held: {id(decoder): _Plan or None} inside plan_held() on this thread


@contextlib.contextmanager
def plan_held(decoder: nn.Module) -> Iterator[None]:
    """While inside, on this thread, ``decoder``'s fast loop checks its layers at its first plain call and reuses
    what it read for the later ones (~0.6 ms a call on Gemma-3-270M int4). For a caller that forwards the decoder
    several times in a row with only its own code in between, which changes no module: a draft's round. Every
    call still checks that it is plain and that the cache keeps its keys in order; a module or config changed
    inside the block (by another thread sharing the model, or a callback) is seen from the block's end, as a
    change during any forward is seen from the next one. Re-entrant."""
    held = _local.__dict__.setdefault("held", {})
    if id(decoder) in held:
        yield
        return
    held[id(decoder)] = None
    try:
        yield
    finally:
        held.pop(id(decoder), None)


def _held_or_new_plan(decoder: nn.Module, cache: Cache) -> _Plan | None:
    held = _local.__dict__.get("held")
    if not held or id(decoder) not in held:
        return _checked_plan(decoder, cache)
    plan = held[id(decoder)]
    if plan is None:
        plan = held[id(decoder)] = _checked_plan(decoder, cache)
    elif not _keeps_keys_in_order(cache, len(plan.layers)):
        return None
    return plan


def _checked_plan(decoder: nn.Module, cache: Cache) -> _Plan | None:
    """:func:`_layer_plan`, read again only where its :class:`_Witness` no longer holds."""
    witness = decoder.__dict__.get(WITNESS_ATTR)
    if witness is not None and witness.holds(decoder):
        return witness.plan if _keeps_keys_in_order(cache, len(witness.plan.layers)) else None
    plan = _layer_plan(decoder, cache)
    decoder.__dict__[WITNESS_ATTR] = None if plan is None else _witness(decoder, plan)
    return plan


_ATTENTION_READS = (attention.OWNED_ATTR, "attn_logit_softcapping", "is_causal", "layer_idx", "head_dim", "scaling")
_HOOK_SLOTS = ("_forward_pre_hooks", "_forward_hooks", "forward", "training", "_modules")


@dataclass(frozen=True)
class _Witness:
    """A decoder's :class:`_Plan` with everything :func:`_layer_plan` read it from, as flat tuples that
    :meth:`holds` walks in C (``map``): reading the plan again costs ~0.5 ms a call on Gemma-3-270M's 18 layers
    with the interpreter's objects in cache (~1 ms after a step's weights evicted them); checking this ~0.1 ms.
    Every attribute, tensor slot and hook dict read, every module's class, every ``_modules`` dict's children in
    order, the config's values: the plan holds while all of them do, and nothing in it depends on anything else."""

    plan: _Plan
    dicts: tuple  # slots: (dict, key) pairs that must still hold the same objects
    keys: tuple
    values: tuple
    objects: tuple  # modules whose class must stay
    types: tuple
    children: tuple  # _modules dicts whose children must stay, in order
    sizes: tuple
    members: tuple
    hooks: tuple  # hook dicts that must stay empty
    captured: tuple  # modules whose forward hooks may be transformers' output capture only
    config: tuple  # _config_reads at the plan's reading

    def holds(self, decoder: nn.Module) -> bool:
        return (all(map(operator.is_, map(dict.get, self.dicts, self.keys, repeat(ABSENT)), self.values))
                and all(map(operator.is_, map(type, self.objects), self.types))
                and all(map(operator.eq, map(len, self.children), self.sizes))
                and all(map(operator.is_, chain.from_iterable(map(dict.values, self.children)), self.members))
                and not any(self.hooks)
                and all(map(_capture_or_none, self.captured))
                and _config_reads(decoder) == self.config)


def _capture_or_none(module: nn.Module) -> bool:
    return not module._forward_hooks or capture_hooks_only(module)


def _config_reads(decoder: nn.Module) -> tuple:
    """What :func:`_layer_plan` reads of the decoder's config (a list in it may change in place)."""
    config = decoder.config
    types = getattr(config, "layer_types", None)
    return (config.num_hidden_layers, getattr(config, "sliding_window", None),
            tuple(types) if isinstance(types, list | tuple) else types)


def _witness(decoder: nn.Module, plan: _Plan) -> _Witness | None:
    """What ``plan`` was read from, or None where some of it cannot be checked that way (a layer's arguments not
    remembered, a dict of another class than ``dict``)."""
    layers = list(decoder.layers)[: len(plan.layers)]
    slots = [(decoder.__dict__, "config"), (decoder._modules, "layers")]
    objects, children, hooks, captured = [decoder, decoder.layers], [decoder.layers._modules], [], []
    sources = []
    for layer, (arguments, *_) in zip(layers, plan.layers):
        read = remembered_sources(layer)
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        if read is None or read.arguments is not arguments:
            return None
        sources.append(read)
        for module in (layer, attn, mlp):
            slots += [(module.__dict__, k) for k in _HOOK_SLOTS]
            children.append(module._modules)
        slots += [(attn.__dict__, k) for k in _ATTENTION_READS]
        objects += [layer, *read.modules]
        hooks += [layer._forward_pre_hooks, *read.hooks]
        captured += [layer, attn]
    dicts, keys = zip(*slots)
    if not all(type(d).get is dict.get for d in (*dicts, *children)):
        return None
    values = tuple(d.get(k, ABSENT) for d, k in slots)
    members = tuple(chain.from_iterable(d.values() for d in children))
    return _Witness(
        plan,
        dicts + tuple(chain.from_iterable(r.dicts for r in sources)),
        keys + tuple(chain.from_iterable(r.keys for r in sources)),
        values + tuple(chain.from_iterable(r.values for r in sources)),
        tuple(objects), tuple(map(type, objects)), tuple(children), tuple(map(len, children)), members,
        tuple(hooks), tuple(captured), _config_reads(decoder))


def _keeps_keys_in_order(cache: Cache, layers: int) -> bool:
    """Whether every layer of ``cache`` returns its keys in order, the last ones the new rows, and the cache sizes its
    masks as transformers' dynamic caches do (a cache with masks of its own, as MTP caches, says more)."""
    cache_layers = getattr(cache, "layers", None)
    return (cache_layers is not None and len(cache_layers) >= layers and all(map(_ordered, cache_layers))
            and type(cache).get_mask_sizes is Cache.get_mask_sizes)


def _layer_plan(decoder: nn.Module, cache: Cache) -> _Plan | None:
    """Each layer's op arguments, cache index, head size, scale and window (as the decoder's masks apply it), or
    None where a layer or the cache is not one the loop reproduces. Attributes are read from the modules' dicts:
    this runs on every call, after the weights have streamed through the CPU caches (each lookup a cache miss)."""
    config = decoder.config
    form = DECODER_FORMS[type(decoder).__name__]
    layers = list(decoder.layers)[: config.num_hidden_layers]  # (a ModuleList slice builds a module: ~0.1 ms)
    if not _keeps_keys_in_order(cache, len(layers)):
        return None
    types = config.layer_types if form.rotary_by_type or form.windows == "types" else None
    sliding = getattr(config, "sliding_window", None) if form.windows else None
    plan = []
    for i, layer in enumerate(layers):
        modules = layer._modules
        attn, mlp = modules.get("self_attn"), modules.get("mlp")
        if not isinstance(layer, KernelLayerMixin) or attn is None or mlp is None:
            return None
        own = attn.__dict__
        if (_hooked(layer) and not capture_hooks_only(layer) or layer.training or attn.training or mlp.training
                or not isinstance(own.get(attention.OWNED_ATTR), KernelAttention)
                or own.get("attn_logit_softcapping") is not None
                or (own["is_causal"] if "is_causal" in own else getattr(type(attn), "is_causal", True)) is not True):
            return None
        arguments = cached_arguments(layer)
        if arguments is None:
            return None
        window = sliding if form.windows == "config" or types is not None and types[i] == "sliding_attention" else None
        if window is not None and window < 2:  # transformers' window of one keeps every key ([-0:]): not a window
            return None
        plan.append((arguments, own["layer_idx"], own["head_dim"], float(own["scaling"]), window or 0))
    return _Plan(plan, list(types[: len(plan)]) if form.rotary_by_type else None)


def _ordered(layer) -> bool:
    cls = type(layer)  # the class's own attribute: a subclass overriding update() says so again, or is not taken
    return cls is DynamicLayer or cls is DynamicSlidingWindowLayer or cls.__dict__.get(KEYS_IN_ORDER, False)


def _updates_layers_only(cache: Cache) -> bool:
    """Whether ``cache.update(k, v, i)`` is ``cache.layers[i].update(k, v)`` and nothing more in this call (so the loop
    may append through a layer's in-place protocol), with no autograd recording the forward."""
    if torch.is_grad_enabled():
        return False
    cls = type(cache)
    if cls.update is Cache.update:
        return not cache.offloading
    says = cls.__dict__.get(UPDATES_LAYERS_ONLY)
    return says is not None and bool(says(cache))


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


def _position_embeddings(decoder: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, plan: _Plan):
    """Each layer's ``(cos, sin)`` as the decoder computes them, or None where a layer's ops do not take them."""
    if plan.types is None:
        shared = decoder.rotary_emb(hidden, positions)
        embeddings = [shared] * len(plan.layers)
    else:
        by_type = {t: decoder.rotary_emb(hidden, positions, t) for t in set(plan.types)}
        embeddings = [by_type[t] for t in plan.types]
    for (_, _, head_dim, _, _), (cos, sin) in zip(plan.layers, embeddings):
        if cos.dtype != hidden.dtype or sin.dtype != hidden.dtype or cos.shape[-1] != head_dim:
            return None
    return embeddings


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
    return mix_out(model, KernelDecoderMixin, forget=(FRESH_LAYER, WITNESS_ATTR))
