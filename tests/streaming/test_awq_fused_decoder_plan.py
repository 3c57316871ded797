"""A fused decoder's plan (``kernels.plan``): read once and checked at every call through its witness, checked once
a block inside ``plan_held``, and read again when anything it was read from changed, with the bits of the decoder's
own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from kvboost_hf.kernels import plan
from kvboost_hf.kernels.decoder import unfuse_decoder
from tests.streaming.fused_models import awq_model, fused_and_plain, prefill_then_steps


def counted_plans(monkeypatch) -> dict:
    """How many times the fused decoder checked its plan (``checks``) and read a layer's arguments (``reads``)."""
    counts = {"checks": 0, "reads": 0}
    check, read = plan.checked_plan, plan.cached_arguments

    def checked(*args):
        counts["checks"] += 1
        return check(*args)

    def cached(layer):
        counts["reads"] += 1
        return read(layer)

    monkeypatch.setattr(plan, "checked_plan", checked)
    monkeypatch.setattr(plan, "cached_arguments", cached)
    return counts


def test_a_held_plan_checks_the_layers_once_and_each_call_still_is_checked(tiny_awq, kernels_built, fast_loops,
                                                                            monkeypatch):
    from kvboost_hf.kernels.plan import plan_held

    model = awq_model("gemma3", tiny_awq, None)
    counts = counted_plans(monkeypatch)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(11))
    layers = model.config.num_hidden_layers

    def run():
        cache = DynamicCache(config=model.config)
        out = [model(input_ids=ids[:, :18], past_key_values=cache).logits]
        with plan_held(model.model), plan_held(model.model):  # re-entrant
            for t in range(18, 24):
                out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits)
        return torch.cat(out, dim=1)

    fused, plain, taken = fused_and_plain(model, run, fast_loops)
    assert taken == 7 and torch.equal(fused, plain)
    assert counts["checks"] == 2  # the prefill's check, and one for the six held calls
    assert counts["reads"] == layers  # the first check read the layers; the second found nothing changed

    with torch.no_grad(), plan_held(model.model):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :18], past_key_values=cache)
        fast_loops["n"] = 0
        padded = torch.ones(1, 19, dtype=torch.long)
        padded[0, 0] = 0
        model(input_ids=ids[:, 18:19], past_key_values=cache, attention_mask=padded)  # not plain: checked anyway
        assert fast_loops["n"] == 0
        static = StaticCache(config=model.config, max_cache_len=32)  # a cache the loop does not take
        model(input_ids=ids[:, :18], past_key_values=static)
        assert fast_loops["n"] == 0
    counts["checks"] = 0
    with torch.no_grad():
        model(input_ids=ids[:, :4], past_key_values=DynamicCache(config=model.config))
    assert counts["checks"] == 1  # outside: checked again


def _scaling(model):
    attn = model.model.layers[1].self_attn
    attn.scaling = attn.scaling * 2.0


def _layer_swapped(model):
    layers = model.model.layers
    layers[0], layers[1] = layers[1], layers[0]  # each keeps its layer_idx: the plan's cache index follows it


def _window(model):
    model.config.sliding_window = 6


def _types_in_place(model):
    model.config.layer_types[0] = "full_attention"  # the list mutated, not replaced


def _training(model):
    model.model.layers[2].mlp.training = True


def _layer_pre_hook(model):
    model.model.layers[1].register_forward_pre_hook(lambda module, args: None)


def _layers_dict_replaced(model):
    layers = model.model.layers
    swapped = dict(layers._modules)
    swapped["1"], swapped["2"] = swapped["2"], swapped["1"]
    layers._modules = swapped  # a new dict; the old one, which the plan was read from, left as it was


def _causal_from_the_class(model):
    for layer in model.model.layers:
        del layer.self_attn.is_causal  # the class's then: the loop does not take a layer that does not say it itself


def _capture_on_attention(model):
    model(input_ids=torch.tensor([[5, 6, 7]]), output_attentions=True)  # installs output capture: still the loop


@pytest.mark.parametrize("change", [_scaling, _layer_swapped, _window, _types_in_place, _training, _layer_pre_hook,
                                    _layers_dict_replaced, _causal_from_the_class, _capture_on_attention])
def test_a_plan_is_read_again_when_what_it_was_read_from_changed(change, tiny_awq, kernels_built, fast_loops,
                                                                 monkeypatch):
    """The decoder remembers its plan with everything it was read from (its witness); a change to any of it after the
    first call (an attention's scale, the layers' order, the config's window or layer types changed in place, a
    training flag, a hook) is seen at the next call, which gives what the decoder's own forward gives."""
    model = awq_model("gemma3", tiny_awq, None)
    counts = counted_plans(monkeypatch)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(13))

    def run():
        return prefill_then_steps(model, ids[:, :16], 12)

    with torch.no_grad():
        before = run()
        counts["reads"] = 0
        run()
        assert counts["reads"] == 0  # nothing changed: the witness held at every call
        change(model)
        fast_loops["n"] = 0
        fused = run()
        taken = fast_loops["n"]
    assert unfuse_decoder(model) == 1
    with torch.no_grad():
        plain = run()
    assert torch.equal(fused, plain)
    # read again (output capture changes no slot; a layer saying nothing of is_causal is refused before its read)
    assert counts["reads"] > 0 or change in (_capture_on_attention, _causal_from_the_class)
    if change in (_window, _types_in_place, _scaling):
        assert taken == 5 and not torch.equal(fused, before)  # still the loop, with what changed
    if change in (_training, _layer_pre_hook, _causal_from_the_class):
        assert taken == 0
    if change is _capture_on_attention:
        assert taken == 5 and torch.equal(fused, before)
