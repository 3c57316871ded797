"""Fused decoder layers (``kernels.layer``) after their first call: a change to what they read (a wrapped projection,
a patched forward, an accelerate hook, a new eps, a norm's class, a bias, a buffer, the biases' dtype) or a hook added
or removed at any time is seen at the next call, which gives the bits of the layer's own modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvboost_hf.kernels.layer import fuse_layers, unfuse_layers
from tests.streaming.conftest import load_awq
from tests.streaming.fused_models import chunked_logits, layer_op_calls

pytestmark = pytest.mark.usefixtures("two_threads")  # the layer ops' column split between threads, as in a real run


class Forwarding(nn.Module):
    """An adapter-style wrapper that forwards attribute lookups to the module it wraps (and adds to it)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, x):
        return self.inner(x) * 1.5


def _wrap_q(model):
    attn = model.model.layers[0].self_attn
    attn.q_proj = Forwarding(attn.q_proj)


def _patch_forward(model):
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x, _f=type(mlp).forward, _m=mlp: _f(_m, x) * 0.5


def _accelerate_hook(model):
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Halve(ModelHook):
        def post_forward(self, module, output):
            return output * 0.5

    add_hook_to_module(model.model.layers[0].mlp.down_proj, Halve())


def _new_eps(model):
    model.model.layers[0].input_layernorm.eps = 0.5


@pytest.mark.parametrize("change", [_wrap_q, _patch_forward, _accelerate_hook, _new_eps])
def test_a_change_the_hooks_do_not_show_still_gives_the_modules_bits(change, tiny_awq, kernels_built):
    """Changes made after the first call that no torch hook registry shows: a wrapper forwarding attribute
    lookups, a forward set on the instance (accelerate's hooks do that), a norm's eps. Each is seen."""
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(17))
    before = chunked_logits(model, ids)
    change(model)
    fused, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    unfuse_layers(model)
    plain = chunked_logits(model, ids)
    assert torch.equal(fused, plain) and not torch.equal(fused, before)
    assert calls == 5 * (len(model.model.layers) - 1)  # layer 0 (for eps: its norms no longer share one) falls back


def _hook_attention_pre(layer):
    return layer.self_attn.register_forward_pre_hook(lambda module, args: None)


def _hook_norm(layer):
    return layer.post_attention_layernorm.register_forward_hook(lambda module, args, out: out * 0.5)


def _hook_projection_dict(layer):
    """A hook dict replaced wholesale (not through register_forward_hook)."""
    proj = layer.mlp.up_proj
    proj._forward_hooks = type(proj._forward_hooks)({0: lambda module, args, out: out * 2.0})

    class Handle:
        def remove(self):
            proj._forward_hooks = type(proj._forward_hooks)()
    return Handle()


@pytest.mark.parametrize("add_hook", [_hook_attention_pre, _hook_norm, _hook_projection_dict])
@pytest.mark.parametrize("first_call_hooked", [True, False])
def test_hooks_added_or_removed_at_any_time_are_seen(add_hook, first_call_hooked, tiny_awq, kernels_built):
    """A layer computes through its modules (and their hooks) exactly while one of them has hooks, whether they
    were there at its first call or came after it, and is fused again once they are gone."""
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    layers = model.model.layers
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(23))
    handle = add_hook(layers[0]) if first_call_hooked else None
    first, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert calls == 5 * (len(layers) - (1 if first_call_hooked else 0))
    if handle is None:
        handle = add_hook(layers[0])
    hooked, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert calls == 5 * (len(layers) - 1)
    handle.remove()
    fused, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert calls == 5 * len(layers)
    unfuse_layers(model)
    plain = chunked_logits(model, ids)
    assert torch.equal(fused, plain)
    if add_hook is not _hook_attention_pre:  # the others change the outputs: the hooked forwards ran them
        assert not torch.equal(hooked, plain)
    assert torch.equal(hooked, first) == first_call_hooked or add_hook is _hook_attention_pre


def _plain(model, run):
    """``run()`` with the layers' own forward (then fused again)."""
    unfuse_layers(model)
    try:
        return run()
    finally:
        fuse_layers(model)


def _gelu_none(layer):
    layer.mlp.act_fn.approximate = "none"  # read as gelu_tanh at the first call


def _norm_class(layer):
    class Doubled(type(layer.input_layernorm)):
        def forward(self, x):
            return super().forward(x) * 2

    layer.input_layernorm.__class__ = Doubled


def _plain_bias(layer):
    q = layer.self_attn.q_proj  # bias registered as None: after del, a plain tensor its forward adds
    del q.bias
    q.bias = torch.randn(q.out_features, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


def _accelerate_removed(layer):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    add_hook_to_module(layer.mlp.down_proj, ModelHook())  # leaves the bound class forward on the instance
    remove_hook_from_module(layer.mlp.down_proj)


def _not_a_dict(layer):
    import collections

    layer.input_layernorm._buffers = collections.UserDict(layer.input_layernorm._buffers)


def _buffers_replaced(layer):
    norm = layer.post_attention_layernorm
    norm._buffers = {**norm._buffers, "scale": norm.scale * 2}  # a new dict holding a new tensor


@pytest.mark.parametrize("change", [_gelu_none, _norm_class, _plain_bias, _accelerate_removed, _not_a_dict,
                                    _buffers_replaced])
def test_what_a_layer_was_read_from_changing_after_its_first_call_is_seen(change, tiny_awq, kernels_built):
    """Changes after the arguments were read and remembered that no tensor slot shows (an activation's form, a
    module's class, a plain bias where a None Parameter was, accelerate's leftover bound forward, a module's
    tensors in a mapping that is not a dict): the fused model still gives its modules' bits."""
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    if change is _gelu_none:
        for layer in model.model.layers:
            layer.mlp.act_fn = nn.GELU(approximate="tanh")
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(29))
    if change is _not_a_dict:  # read with it (a mapping the check cannot walk in C: read on every call)
        change(model.model.layers[0])
    before = chunked_logits(model, ids)
    change(model.model.layers[0])
    fused, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert torch.equal(fused, _plain(model, lambda: chunked_logits(model, ids)))
    if change in (_accelerate_removed, _not_a_dict):  # nothing the layer computes changed: still fused
        assert calls == 5 * len(model.model.layers) and torch.equal(fused, before)
    else:
        assert not torch.equal(fused, before)


def test_a_dtype_change_of_the_biases_keeps_the_layers_fused(tiny_awq, kernels_built):
    """``Module.to`` converts Parameters in place: the bias dtypes are checked on each call, not remembered."""
    model = load_awq(tiny_awq["qwen2"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(37))
    chunked_logits(model, ids)
    model.to(torch.float32)
    fused, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert calls == 5 * len(model.model.layers)
    assert torch.equal(fused, _plain(model, lambda: chunked_logits(model, ids)))
