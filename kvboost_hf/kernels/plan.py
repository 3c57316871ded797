"""The fused decoder's plan: what each layer's ops take, read off the decoder's modules, and when it may be reused.

:func:`layer_plan` reads, per layer, the ops' arguments (:func:`~.layer.cached_arguments`), the cache index, head
size, scale and window, or says the loop cannot reproduce the decoder (module docstring of :mod:`.decoder`). It
runs whenever what it read may have changed: a :class:`_Witness` remembers everything it read, as flat tuples
checked in C, and :func:`checked_plan` reads the plan again only where one of them changed. Inside
:func:`plan_held` a caller that forwards a decoder several times in a row skips even that check.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat

from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvboost_hf.kernels.attention import KernelAttention
from kvboost_hf.kernels.layer import (
    ABSENT,
    KernelLayerMixin,
    _hooked,
    cached_arguments,
    capture_hooks_only,
    remembered_sources,
)
from kvboost_hf.models import attention

KEYS_IN_ORDER = "kvboost_keys_in_order"  # a cache layer class attribute: update() returns every key, in order
WITNESS_ATTR = "_kvboost_plan_witness"  # a fused decoder's attribute: its last plan and what it was read from


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

@dataclass
class Plan:
    """What the fast loop computes each layer with."""

    layers: list  # (LayerArguments, cache index, head size, scale, window or 0) per layer, in order
    types: list | None  # the layers' types (Gemma 3's rotary per type), else None
    rotary: tuple = field(init=False)  # the rotary embeddings' kinds a call computes: the types in order, or (None,)
    rope: tuple = field(init=False)  # each layer's index into rotary
    fused: tuple | None = None  # decoder_step's per-layer arguments as flat lists, made at their first use

    def __post_init__(self) -> None:
        self.rotary = (None,) if self.types is None else tuple(dict.fromkeys(self.types))
        self.rope = (0,) * len(self.layers) if self.types is None else tuple(map(self.rotary.index, self.types))



_local = threading.local()  # .held: {id(decoder): Plan or None} inside plan_held() on this thread


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


def held_or_new_plan(decoder: nn.Module, cache: Cache) -> Plan | None:
    held = _local.__dict__.get("held")
    if not held or id(decoder) not in held:
        return checked_plan(decoder, cache)
    plan = held[id(decoder)]
    if plan is None:
        plan = held[id(decoder)] = checked_plan(decoder, cache)
    elif not _keeps_keys_in_order(cache, len(plan.layers)):
        return None
    return plan


def checked_plan(decoder: nn.Module, cache: Cache) -> Plan | None:
    """:func:`layer_plan`, read again only where its :class:`_Witness` no longer holds."""
    witness = decoder.__dict__.get(WITNESS_ATTR)
    if witness is not None and witness.holds(decoder):
        return witness.plan if _keeps_keys_in_order(cache, len(witness.plan.layers)) else None
    plan = layer_plan(decoder, cache)
    decoder.__dict__[WITNESS_ATTR] = None if plan is None else _witness(decoder, plan)
    return plan


_ATTENTION_READS = (attention.OWNED_ATTR, "attn_logit_softcapping", "is_causal", "layer_idx", "head_dim", "scaling")
# read of the layer, its attention and its MLP: their training flags and children, and the layer's own hooks (the
# attention's and the MLP's are among the slots of the layer's ArgumentSources, which covers the layer's children)
_MODULE_SLOTS = ("training", "_modules")
_LAYER_SLOTS = (*_MODULE_SLOTS, "_forward_pre_hooks", "_forward_hooks", "forward")


@dataclass(frozen=True)
class _Witness:
    """A decoder's :class:`Plan` with everything :func:`layer_plan` read it from, as flat tuples that
    :meth:`holds` walks in C (``map``): reading the plan again costs ~0.5 ms a call on Gemma-3-270M's 18 layers
    with the interpreter's objects in cache (~1 ms after a step's weights evicted them); checking this ~0.1 ms
    there (an AVX-512 host; on the AVX2 Zen 3 VM 0.55-0.72 ms, ~1.2 ms after a 64 MB sweep: ~3000 lookups in 668
    dicts, which an ``itemgetter`` a dict did not make cheaper).
    Every attribute, tensor slot and hook dict read, every module's class, every ``_modules`` dict's children in
    order, the config's values: the plan holds while all of them do, and nothing in it depends on anything else."""

    plan: Plan
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
    # the decoder's class, config and _modules dict: checked on the decoder given, not held through it (the witness
    # lives in the decoder's __dict__: holding the decoder would keep a deleted model alive until a gc pass)
    owner: tuple

    def holds(self, decoder: nn.Module) -> bool:
        own = decoder.__dict__
        return (type(decoder) is self.owner[0] and own.get("config") is self.owner[1]
                and own.get("_modules") is self.owner[2]
                and all(map(operator.is_, map(dict.get, self.dicts, self.keys, repeat(ABSENT)), self.values))
                and all(map(operator.is_, map(type, self.objects), self.types))
                and all(map(operator.eq, map(len, self.children), self.sizes))
                and all(map(operator.is_, chain.from_iterable(map(dict.values, self.children)), self.members))
                and not any(self.hooks)
                and all(map(_capture_or_none, self.captured))
                and _config_reads(decoder) == self.config)


def _capture_or_none(module: nn.Module) -> bool:
    return not module._forward_hooks or capture_hooks_only(module)


def _config_reads(decoder: nn.Module) -> tuple:
    """What :func:`layer_plan` reads of the decoder's config (a list in it may change in place)."""
    config = decoder.config
    types = getattr(config, "layer_types", None)
    return (config.num_hidden_layers, getattr(config, "sliding_window", None),
            tuple(types) if isinstance(types, list | tuple) else types)


def _witness(decoder: nn.Module, plan: Plan) -> _Witness | None:
    """What ``plan`` was read from, or None where some of it cannot be checked that way (a layer's arguments not
    remembered, a dict of another class than ``dict``)."""
    layers = list(decoder.layers)[: len(plan.layers)]
    slots = [(decoder._modules, "layers"), (decoder.layers.__dict__, "_modules")]
    objects, children, hooks, captured = [decoder.layers], [decoder.layers._modules], [], []
    sources = []
    for layer, (arguments, *_) in zip(layers, plan.layers):
        read = remembered_sources(layer)
        attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
        if read is None or read.arguments is not arguments:
            return None
        sources.append(read)
        slots += [(layer.__dict__, k) for k in _LAYER_SLOTS]
        slots += [(module.__dict__, k) for module in (attn, mlp) for k in _MODULE_SLOTS]
        children += [layer._modules, attn._modules, mlp._modules]
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
        tuple(hooks), tuple(captured), _config_reads(decoder),
        (type(decoder), decoder.__dict__.get("config"), decoder.__dict__.get("_modules")))


def _keeps_keys_in_order(cache: Cache, layers: int) -> bool:
    """Whether every layer of ``cache`` returns its keys in order, the last ones the new rows, and the cache sizes its
    masks as transformers' dynamic caches do (a cache with masks of its own, as MTP caches, says more)."""
    cache_layers = getattr(cache, "layers", None)
    return (cache_layers is not None and len(cache_layers) >= layers and all(map(_ordered, cache_layers))
            and type(cache).get_mask_sizes is Cache.get_mask_sizes)


def layer_plan(decoder: nn.Module, cache: Cache) -> Plan | None:
    """Each layer's op arguments, cache index, head size, scale and window (as the decoder's masks apply it), or
    None where a layer or the cache is not one the loop reproduces. Attributes are read from the modules' dicts: this
    runs after the weights have streamed through the CPU caches (each lookup a cache miss), at every call whose
    witness no longer holds."""
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
                or own.get("is_causal") is not True):  # (every known attention sets its own in __init__)
            return None
        arguments = cached_arguments(layer)
        if arguments is None:
            return None
        window = sliding if form.windows == "config" or types is not None and types[i] == "sliding_attention" else None
        if window is not None and window < 2:  # transformers' window of one keeps every key ([-0:]): not a window
            return None
        plan.append((arguments, own["layer_idx"], own["head_dim"], float(own["scaling"]), window or 0))
    return Plan(plan, list(types[: len(plan)]) if form.rotary_by_type else None)


def _ordered(layer) -> bool:
    cls = type(layer)  # the class's own attribute: a subclass overriding update() says so again, or is not taken
    return cls is DynamicLayer or cls is DynamicSlidingWindowLayer or cls.__dict__.get(KEYS_IN_ORDER, False)
