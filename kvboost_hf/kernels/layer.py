"""``fuse_layers``: the decoder layers of a model on kvboost_hf's int4 kernels, two C++ op calls each.

A CPU decode step of a small int4 model spends more time calling ops than computing: Gemma-3-270M's
18 layers make ~40 small ATen ops and module calls each (norms, projections, views, RoPE's six ops,
residual adds), ~0.5 ms a layer against ~0.2 ms of int4 arithmetic. A fused layer computes what comes
before attention (``torch.ops.kvboost.layer_attention_inputs``) and what comes after it
(``torch.ops.kvboost.layer_output``) in one call each; the cache update and the attention function stay
in Python, as transformers calls them, so every cache and every attention route (a packed batch, a
row-exact verification, a scattered repair) works unchanged.

Exact: the ops compute the bits the layer's modules compute (``csrc/layer.cpp``): same kernels, same
roundings. A layer is fused only where every module it bypasses is one whose computation the ops
reproduce (:class:`~kvboost_hf.kernels.norm.KernelRMSNorm` norms, int4 linears on kvboost_hf's kernel
that say so through ``kernel_blocks()``, a known activation) and has no hooks; anything else, checked
on every call, runs the layer's own forward (a LoRA-wrapped projection, a training model, output
capture of attention weights, a model under ``torch.compile``).
"""

from __future__ import annotations

import copyreg
import functools
import logging
import operator
import types
from dataclasses import dataclass
from itertools import repeat

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvboost_hf.kernels import ops
from kvboost_hf.kernels.norm import KernelRMSNorm

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class LayerForm:
    """What a decoder-layer class's forward does that the ops must follow. ``sandwich``: Gemma's norms on the
    branch outputs (post-attention, pre- and post-feed-forward), else Llama's (``post_attention_layernorm``
    before the MLP); ``attention`` / ``mlp``: the classes of its submodules whose forward was read;
    ``window``: where its attention call's ``sliding_window`` comes from (``"layer"``: the attention module,
    ``"config"``: its config, None: not passed)."""

    sandwich: bool
    attention: str
    mlp: str
    window: str | None


FORMS = {  # layer classes whose forward (transformers 5.x) the ops reproduce, read line by line
    "Gemma3DecoderLayer": LayerForm(True, "Gemma3Attention", "Gemma3MLP", "layer"),
    "LlamaDecoderLayer": LayerForm(False, "LlamaAttention", "LlamaMLP", None),
    "MistralDecoderLayer": LayerForm(False, "MistralAttention", "MistralMLP", "config"),
    "Qwen2DecoderLayer": LayerForm(False, "Qwen2Attention", "Qwen2MLP", "layer"),
    "Qwen3DecoderLayer": LayerForm(False, "Qwen3Attention", "Qwen3MLP", "layer"),
}
_NORMS = {True: ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
          False: ("input_layernorm", None, "post_attention_layernorm", None)}
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def activation_name(act: nn.Module) -> str | None:
    """The op's name for an MLP activation it computes as torch does (``gelu_tanh``, ``gelu``, ``silu``), else None."""
    if _hooked(act):
        return None
    if type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation":
        return "silu"
    if type(act) is nn.GELU:
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    inner = getattr(act, "act", None)  # transformers' GELUTanh: functools.partial(F.gelu, approximate="tanh")
    if (type(act).__name__ == "GELUTanh" and isinstance(inner, functools.partial)
            and inner.func is nn.functional.gelu and inner.keywords == {"approximate": "tanh"} and not inner.args):
        return "gelu_tanh"
    return None


def _hooked(module: nn.Module) -> bool:
    """Hooks, or a ``forward`` set on the instance (accelerate's ``add_hook_to_module`` and offloading do that)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or _instance_forward(module)


def _instance_forward(module: nn.Module) -> bool:
    """Whether the instance has a ``forward`` of its own other than its class's, bound to it (what accelerate's
    ``remove_hook_from_module`` leaves behind)."""
    f = module.__dict__.get("forward", ABSENT)
    return f is not ABSENT and not (isinstance(f, types.MethodType) and f.__self__ is module
                                     and f.__func__ is getattr(type(module), "forward", None))


def global_hooks() -> bool:
    """Whether hooks for every module's call are registered (``register_module_forward_hook`` and its pre-hook kind):
    a path that computes modules without calling them would skip those."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


ABSENT = object()  # a key not in a dict (None may be a value: a bias registered as None, forward = None)


def _int4(module: nn.Module | None):
    """``module``'s ``kernel_blocks()``, where its own class both defines that and computes its forward (a
    wrapper forwarding attribute lookups, or a subclass overriding ``forward`` alone, does not count)."""
    if module is None or _hooked(module):
        return None
    cls = type(module)
    owner = next((c for c in cls.__mro__ if "kernel_blocks" in c.__dict__), None)
    if owner is None or next(c for c in cls.__mro__ if "forward" in c.__dict__) is not owner:
        return None
    return module.kernel_blocks()


def _scale(norm: nn.Module | None):
    return norm.scale if type(norm) is KernelRMSNorm and not _hooked(norm) else None


def _cpu_tensor(t) -> bool:
    return t is None or t.device.type == "cpu"


@dataclass
class LayerArguments:
    """What the two ops take for one layer, read off its modules for this call."""

    qweights: list
    sides: list
    outs: list
    groups: list
    biases: list
    norms: list  # input, post-attention (or None), feed-forward, post-feed-forward (or None)
    eps: float
    head_norms: tuple | None  # (q scale, k scale, eps)
    activation: str
    window: str | None  # LayerForm.window
    has_bias: bool  # whether any projection has a bias

    @property
    def bias_dtypes(self) -> frozenset:
        """The projections' bias dtypes now (``Module.to`` converts a Parameter in place): each must be the
        activations' dtype, else torch promotes and the ops do not reproduce the layer."""
        return frozenset(b.dtype for b in self.biases if b is not None)

    def inputs(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple:
        """``torch.ops.kvboost.layer_attention_inputs``' arguments for ``hidden`` and RoPE's ``cos``/``sin``."""
        q_norm, k_norm, head_eps = self.head_norms or (None, None, 0.0)
        return (hidden, self.norms[0], self.eps, self.qweights[:3], self.sides[:3], self.outs[:3], self.groups[:3],
                self.biases[:3], q_norm, k_norm, head_eps, cos, sin, head_dim)

    def output(self, residual: torch.Tensor, attn: torch.Tensor) -> tuple:
        """``torch.ops.kvboost.layer_output``'s arguments for the layer's input ``residual`` and attention output."""
        return (residual, attn, self.qweights[3:], self.sides[3:], self.outs[3:], self.groups[3:], self.biases[3:],
                self.norms[1], self.norms[2], self.norms[3], self.eps, self.activation)

    def step(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple:
        """``torch.ops.kvboost.layer_step``'s arguments up to the cache's buffers (which follow, with the live
        keys' first position, the new rows' position, the attention's scale and window)."""
        q_norm, k_norm, head_eps = self.head_norms or (None, None, 0.0)
        return (hidden, self.qweights, self.sides, self.outs, self.groups, self.biases, *self.norms, self.eps, q_norm,
                k_norm, head_eps, cos, sin, head_dim, self.activation)


def layer_arguments(layer: nn.Module) -> LayerArguments | None:
    """The ops' arguments for ``layer`` as it stands now, or None where the ops would not reproduce it."""
    form = FORMS.get(type(layer).__name__)  # a fused layer's class keeps its name
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if (form is None or type(attn).__name__ != form.attention or type(mlp).__name__ != form.mlp
            or layer.training or attn.training or mlp.training
            or _hooked(mlp) or _hooked(attn) and not _capture_only(attn, attn)):
        return None
    activation = activation_name(getattr(mlp, "act_fn", None))
    if activation is None:
        return None
    qweights, sides, outs, groups, biases = [], [], [], [], []
    for owner, name in PROJECTIONS:
        p = getattr(attn if owner == "self_attn" else mlp, name, None)
        blocks = _int4(p)
        if blocks is None or not _cpu_tensor(p.bias) or p.bias is not None and p.bias.shape != (p.out_features,):
            return None
        qweights.append(blocks[0])
        sides.append(blocks[1])
        outs.append(p.out_features)
        groups.append(p.group_size)
        biases.append(p.bias)
    modules = [getattr(layer, n) if n else None for n in _NORMS[form.sandwich]]
    norms = [_scale(m) if m is not None else None for m in modules]
    if norms[0] is None or norms[2] is None or (form.sandwich and (norms[1] is None or norms[3] is None)):
        return None
    eps = {m.eps for m in modules if m is not None}
    head_norms = None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        q, k = _scale(getattr(attn, "q_norm", None)), _scale(getattr(attn, "k_norm", None))
        if q is None or k is None or attn.q_norm.eps != attn.k_norm.eps:
            return None
        head_norms = (q, k, attn.q_norm.eps)
    if (len(eps) != 1 or groups[1:3] != groups[:1] * 2 or groups[4] != groups[5]
            or not all(_cpu_tensor(t) for t in (*qweights, *sides, *norms))):
        return None
    return LayerArguments(qweights, sides, outs, groups, biases, norms, eps.pop(), head_norms, activation, form.window,
                          any(b is not None for b in biases))


class KernelLayerMixin:
    """The forward of a fused decoder layer (mixed into the layer's own class by :func:`fuse_layers`)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        interface = None if args else self._attention_function(hidden_states, kwargs)
        a = None if interface is None else cached_arguments(self)
        if a is None or a.has_bias and a.bias_dtypes != {hidden_states.dtype}:
            return super().forward(hidden_states, *args, **kwargs)
        attn = self.self_attn
        cos, sin = kwargs.pop("position_embeddings")
        attention_mask = kwargs.pop("attention_mask", None)
        past_key_values = kwargs.pop("past_key_values", None)
        kwargs["position_ids"] = kwargs.get("position_ids")
        q, k, v = torch.ops.kvboost.layer_attention_inputs(*a.inputs(hidden_states, cos, sin, attn.head_dim))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attn.layer_idx)
        if a.window == "layer":  # as each class's attention passes it (LayerForm.window)
            kwargs["sliding_window"] = attn.sliding_window
        elif a.window == "config":
            kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
        out, weights = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        if weights is not None:  # output capture (the only hooks a fused layer's attention may have) takes them
            for hook in list(attn._forward_hooks.values()):
                hook(attn, (), (None, weights))
        return torch.ops.kvboost.layer_output(*a.output(hidden_states, out))

    def _attention_function(self, hidden_states: torch.Tensor, kwargs: dict):
        """transformers' attention function this call's layer runs, or None where the ops do not take this call."""
        # Submodules read from _modules, not through nn.Module.__getattr__: this runs in every layer of every
        # decode step, after the weights have streamed through the caches (each Python lookup a cache miss).
        embeddings = kwargs.get("position_embeddings")
        attn, mlp = self._modules.get("self_attn"), self._modules.get("mlp")
        if (self.training or attn is None or attn.training or mlp is None or mlp.training or embeddings is None
                or not hidden_states.is_cpu or hidden_states.dim() != 3
                or hidden_states.dtype not in _DTYPES or torch.compiler.is_compiling()
                or torch.is_grad_enabled() and hidden_states.requires_grad
                or global_hooks()):
            return None
        cos, sin = embeddings
        if cos.dtype != hidden_states.dtype or sin.dtype != hidden_states.dtype or cos.shape[-1] != attn.head_dim:
            return None
        return ALL_ATTENTION_FUNCTIONS.get(getattr(attn.config, "_attn_implementation", None))  # None for eager

    def __reduce_ex__(self, protocol):
        """Copy and pickle as the layer's own class (as a reuse-enabled model does): loading needs only
        transformers; :func:`fuse_layers` fuses the copy again."""
        return as_own_class(self, (ARGUMENTS_ATTR,))  # the arguments are read again by the copy


_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class ArgumentSources:
    """What :func:`layer_arguments` read, as parallel tuples that the check walks in C (``map``), not in Python."""

    modules: tuple  # the layer's, attention's and MLP's children
    types: tuple  # their classes (a class assigned in place changes what a module computes)
    dicts: tuple  # where each slot was read: a module's _buffers, _parameters or __dict__ (each a dict)
    keys: tuple
    values: tuple  # their tensors, plain attributes and hook dicts, or ABSENT (no forward set on the instance)
    hooks: tuple  # the modules' hook dicts, which must stay empty (attention's forward hooks: capture_hooks)
    capture_hooks: dict  # the attention module's forward hooks (output capture may stay installed)
    arguments: LayerArguments | None


def cached_arguments(layer: nn.Module) -> LayerArguments | None:
    """:func:`layer_arguments`, read again only when one of the modules, tensors, plain attributes or hook dicts it
    came from was replaced, and None while any of those modules has hooks.

    Reading costs ~45 us a layer; checking ~9 us with the interpreter's objects in cache, ~63 us after a decode
    step's weights have streamed through the caches (as in every layer of a step; ~100 us when the check walked
    the slots in a Python generator and called ``_hooked`` per module: an int4 self-draft token 7.95 -> 7.59 ms,
    the target's step 18.7 -> 18.3 ms)."""
    attn, mlp = layer._modules.get("self_attn"), layer._modules.get("mlp")
    if attn is None or mlp is None:
        return None
    modules = (*layer._modules.values(), *attn._modules.values(), *mlp._modules.values())
    cached = layer.__dict__.get(ARGUMENTS_ATTR)
    if (cached is not None and len(cached.modules) == len(modules) and all(map(operator.is_, cached.modules, modules))
            and all(map(operator.is_, map(type, modules), cached.types))
            and all(map(operator.is_, map(dict.get, cached.dicts, cached.keys, repeat(ABSENT)), cached.values))):
        # the same hook dicts as when read (checked just above): hooks added since are in them
        return None if any(cached.hooks) or cached.capture_hooks and not _capture_only(attn, attn) else cached.arguments
    if any(m is None or _hooked(m) and not _capture_only(m, attn) for m in modules):
        return None  # (not remembered: what layer_arguments reads of a hooked module is not what it computes)
    cached = _read(layer, modules, attn)
    if cached is None:  # a module holds its tensors in a mapping that is not a dict: read on every call
        return layer_arguments(layer)
    # On the layer, not in a module-level table: a table's entry would keep a model alive through any reference
    # from one of its modules back to it (a hook's closure).
    layer.__dict__[ARGUMENTS_ATTR] = cached
    return cached.arguments


def remembered_sources(layer: nn.Module) -> ArgumentSources | None:
    """What :func:`cached_arguments` last read ``layer``'s arguments from, or None where it remembers nothing (never
    called, or the modules hold their tensors in mappings it cannot check). Valid as long as every slot still holds
    its value, every module its class, and every hook dict stays empty (the attention's output capture aside)."""
    return layer.__dict__.get(ARGUMENTS_ATTR)


def _read(layer: nn.Module, modules: tuple, attn: nn.Module) -> ArgumentSources | None:
    """:func:`layer_arguments` of ``layer``, whose ``modules`` have no hooks now, with what it was read from
    (None where that cannot be checked with ``dict.get``)."""
    slots = [(d, k, v) for m in modules for d in (m._buffers, m._parameters) for k, v in d.items()]
    slots += [(m.__dict__, k, m.__dict__[k]) for m in modules for k in _READ_ATTRIBUTES if k in m.__dict__]
    slots += [(m.__dict__, k, m.__dict__.get(k, ABSENT)) for m in modules for k in _HOOK_ATTRIBUTES]
    if not all(type(d).get is dict.get for d, _, _ in slots):
        return None
    hooks = [m.__dict__.get(k) for m in modules for k in _HOOK_DICTS if not (m is attn and k == "_forward_hooks")]
    dicts, keys, values = zip(*slots)
    capture = attn.__dict__.get("_forward_hooks")
    return ArgumentSources(modules, tuple(map(type, modules)), dicts, keys, values, tuple(hooks), capture,
                   layer_arguments(layer))


# The plain attributes of the modules that layer_arguments reads (a norm's eps, a projection's sizes and streaming
# state, a bias set as a plain tensor once its Parameter was deleted, an activation's form); training is checked on
# every call (_attention_function).
_READ_ATTRIBUTES = ("staged_weight", "streamed", "eps", "out_features", "group_size", "kernel", "bias",
                    "approximate", "act")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
# What _hooked reads ("forward": an instance's, absent or not), and the dicts the tensor slots were read from.
_HOOK_ATTRIBUTES = (*_HOOK_DICTS, "forward", "_buffers", "_parameters")
CAPTURE_HOOKS = "transformers.utils.output_capturing"  # where transformers' output-capture hooks are defined


def _capture_only(module: nn.Module, attn: nn.Module) -> bool:
    """Whether ``module`` is the attention module and its only hooks are transformers' output capture: the fused
    forward passes it the attention weights itself (none from a non-eager attention function)."""
    return module is attn and capture_hooks_only(module)


def capture_hooks_only(module: nn.Module) -> bool:
    """Whether ``module``'s only hooks are transformers' output capture, which stays installed once any call asked
    for hidden states or attentions and records only while one does."""
    return not module._forward_pre_hooks and not _instance_forward(module) and all(
        getattr(hook, "__module__", None) == CAPTURE_HOOKS for hook in module._forward_hooks.values())


ARGUMENTS_ATTR = "_kvboost_layer_arguments"  # where a fused layer keeps its ArgumentSources (not copied with it)


@functools.cache
def mixed_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first, under ``cls``'s name: transformers matches modules by class name
    (``_no_split_modules``, device maps)."""
    return type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def mix_in(model: nn.Module, names, mixin: type) -> int:
    """Give every module of ``model`` whose class name is in ``names`` the class :func:`mixed_class` makes (where the
    kernels are loaded); returns how many modules have it now."""
    if not ops.loaded():
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in names:
            if not isinstance(module, mixin):
                module.__class__ = mixed_class(mixin, type(module))
            count += 1
    return count


def as_own_class(module: nn.Module, forget: tuple = ()) -> tuple:
    """``__reduce_ex__``'s answer for a module :func:`mix_in` gave a mixed class: the module as its own class, without
    the attributes ``forget``, so a copy or an unpickled module runs transformers' forward until fused again."""
    state = {k: v for k, v in module.__getstate__().items() if k not in forget}
    return copyreg._reconstructor, (type(module).__bases__[-1], object, None), state


def mix_out(model: nn.Module, mixin: type, forget: tuple = ()) -> int:
    """Undo :func:`mix_in` (each module its own class again, without the attributes ``forget``); returns how many."""
    restored = 0
    for module in model.modules():
        if isinstance(module, mixin):
            module.__class__ = type(module).__bases__[-1]
            for name in forget:
                module.__dict__.pop(name, None)
            restored += 1
    return restored


def fuse_layers(model: nn.Module) -> int:
    """Make the decoder layers of ``model`` that :data:`FORMS` knows compute through the two layer ops where
    :func:`layer_arguments` finds them reproducible (checked on every call); returns how many. For models
    whose numerics kvboost_hf owns (int4 on its kernels): nothing changes but speed."""
    fused = mix_in(model, FORMS, KernelLayerMixin)
    if fused:
        logger.info("%s: %d decoder layers on the fused layer ops", type(model).__name__, fused)
    return fused


def unfuse_layers(model: nn.Module) -> int:
    """Undo :func:`fuse_layers` (the layers' own forward again); returns how many layers changed."""
    return mix_out(model, KernelLayerMixin, (ARGUMENTS_ATTR,))
