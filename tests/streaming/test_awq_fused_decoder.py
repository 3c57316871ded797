"""Fused decoders (``kernels.decoder``): a plain forward of an int4 model on our kernels runs its layers as one
loop of op calls, with the bits of transformers' decoder forward (masks, layer modules, attention dispatch);
any call that is not plain runs that forward."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache, StaticCache

from kvboost_hf.cache import BufferedCache, KIVICache
from kvboost_hf.kernels import plan
from kvboost_hf.kernels.decoder import KernelDecoderMixin, fuse_decoder
from kvboost_hf.models import attention
from kvboost_hf.speculative.exact_rows import route_rows
from tests.streaming.conftest import load_awq
from tests.streaming.fused_models import awq_model, chunked_logits, fused_and_plain, prefill_then_steps


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_plain_forward_takes_the_loop_with_the_decoders_bits(family, dtype, tiny_awq, tiny_mistral_awq,
                                                               kernels_built, fast_loops):
    model = awq_model(family, tiny_awq, tiny_mistral_awq, dtype)
    assert isinstance(model.model, KernelDecoderMixin)  # the loader fused it
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))  # past the 16-token window
    for mask in (None, torch.ones_like(ids)):
        fused, plain, taken = fused_and_plain(model, lambda: chunked_logits(model, ids, mask), fast_loops)
        assert taken == 5 and torch.equal(fused, plain)


@pytest.mark.parametrize("cache_class", [DynamicCache, BufferedCache])
def test_a_batch_and_a_cache_holding_more_than_the_window(cache_class, tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (3, 40), generator=torch.Generator().manual_seed(6))

    def run():
        cache = cache_class(config=model.config)
        out = [model(input_ids=ids[:, :31], past_key_values=cache).logits]
        for start in range(31, 40, 3):  # 3-row chunks: a sliding layer returns its window and the new rows
            out.append(model(input_ids=ids[:, start:start + 3], past_key_values=cache).logits)
        return torch.cat(out, dim=1)

    fused, plain, taken = fused_and_plain(model, run, fast_loops)
    assert taken == 4 and torch.equal(fused, plain)


def test_inputs_embeds_and_a_decode_exact_route_take_the_loop(tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 28), generator=torch.Generator().manual_seed(7))

    def run():
        cache = DynamicCache(config=model.config)
        first = model(inputs_embeds=model.model.embed_tokens(ids[:, :19]), past_key_values=cache).logits
        route_rows(9)  # as a verification routes it
        try:
            rows = model(input_ids=ids[:, 19:], past_key_values=cache).logits
        finally:
            route_rows(None)
        return torch.cat([first, rows], dim=1)

    fused, plain, taken = fused_and_plain(model, run, fast_loops)
    assert taken == 2 and torch.equal(fused, plain)


def _hooked_layer(model):
    seen = []
    return seen, model.model.layers[2].register_forward_hook(lambda m, a, out: seen.append(1))


NOT_PLAIN = {  # name -> (setup(model) -> undo or None, forward kwargs(model, ids, cache))
    "left padding": (None, lambda m, ids, c: {"attention_mask": torch.tensor([[0, 0] + [1] * (ids.shape[1] - 2),
                                                                              [1] * ids.shape[1]])}),
    "shifted positions": (None, lambda m, ids, c: {"position_ids": torch.arange(3, 3 + ids.shape[1])[None]}),
    "hidden states": (None, lambda m, ids, c: {"output_hidden_states": True}),
    "a 4-D mask": (None, lambda m, ids, c: {"attention_mask": torch.ones(2, 1, ids.shape[1], ids.shape[1],
                                                                         dtype=torch.bool).tril()}),
    "a static cache": (None, lambda m, ids, c: {"past_key_values": StaticCache(config=m.config, max_cache_len=64)}),
    "a quantized cache": (None, lambda m, ids, c: {"past_key_values": KIVICache(m.config, bits=4, residual_length=4)}),
    "a layer hook": (lambda m: _hooked_layer(m)[1].remove, lambda m, ids, c: {}),
    "a layer in training mode": (lambda m: (m.model.layers[1].train(), m.model.layers[1].eval)[1],
                                 lambda m, ids, c: {}),
    "a packed route": (lambda m: (attention.set_attention_route(attention.sdpa_forward),
                                  lambda: attention.set_attention_route(None))[1], lambda m, ids, c: {}),
    "scattered queries": (lambda m: (attention.set_scattered_queries(attention.ScatteredQueries(
        torch.arange(100, 120), 500)), lambda: attention.set_scattered_queries(None))[1], lambda m, ids, c: {}),
}


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_a_forward_that_is_not_plain_runs_the_decoders_forward(case, tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(8))
    setup, arguments = NOT_PLAIN[case]

    def run():
        undo = setup(model) if setup else None
        try:
            cache = DynamicCache(config=model.config)
            out = model(input_ids=ids, **{"past_key_values": cache, **arguments(model, ids, cache)})
        finally:
            if undo:
                undo()
        logits = out[0] if isinstance(out, tuple) else out.logits
        states = () if isinstance(out, tuple) or out.hidden_states is None else out.hidden_states
        return torch.cat([logits.flatten(), *(h.flatten() for h in states)])

    fused, plain, taken = fused_and_plain(model, run, fast_loops)
    assert taken == 0 and torch.equal(fused, plain)


def test_a_decoder_asked_for_a_tuple_gives_one(tiny_awq, kernels_built, fast_loops):
    model = awq_model("qwen2", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 12))

    def run():
        out = model.model(input_ids=ids, past_key_values=DynamicCache(config=model.config), return_dict=False)
        assert isinstance(out, tuple)
        return out[0]

    fused, plain, taken = fused_and_plain(model, run, fast_loops)
    assert taken == 0 and torch.equal(fused, plain)
    with torch.no_grad():  # through the CausalLM (which asks its decoder for a dict): the loop
        out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), return_dict=False)
    assert isinstance(out, tuple) and fast_loops["n"] == 1


def test_a_global_module_hook_sees_every_module_call(tiny_awq, kernels_built, fast_loops):
    """A hook for every module's call (``register_module_forward_hook``) runs on each module as in the decoder's own
    forward: the fast loop, the fused layers and the rotary blocks step aside while one is set, with the same bits."""
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(8))
    calls: list[str] = []
    names = {module: name for name, module in model.named_modules()}
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: calls.append(names.get(module, "")))
    try:
        fused, plain, taken = fused_and_plain(model, lambda: prefill_then_steps(model, ids, 12), fast_loops)
    finally:
        handle.remove()
    assert taken == 0 and torch.equal(fused, plain)
    half = len(calls) // 2  # the fused run's calls, then transformers' forward's
    assert calls[:half] == calls[half:] and sum(name.endswith(".mlp") for name in calls[:half]) == 9 * 6
    with torch.no_grad():
        prefill_then_steps(model, ids, 12)
    assert fast_loops["n"] > 0  # removed: the loop again


def test_a_hook_on_a_layer_still_runs(tiny_awq, kernels_built, fast_loops):
    model = awq_model("llama", tiny_awq, None)
    seen, handle = _hooked_layer(model)
    torch.set_grad_enabled(False)
    model(input_ids=torch.randint(3, 96, (1, 12)), past_key_values=DynamicCache(config=model.config))
    handle.remove()
    assert seen == [1] and fast_loops["n"] == 0
    model(input_ids=torch.randint(3, 96, (1, 12)), past_key_values=DynamicCache(config=model.config))
    torch.set_grad_enabled(True)
    assert fast_loops["n"] == 1  # gone: the loop again


def test_generate_and_speculation_take_the_loop_with_the_same_tokens(tiny_awq, kernels_built, fast_loops,
                                                                    monkeypatch):
    from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, make_head_draft
    from kvboost_hf.speculative import head_draft

    rounds = []  # the head draft's rounds as one op call each (kernels.draft_round): its rows, forwarded in the op
    real = head_draft.draft_round
    monkeypatch.setattr(head_draft, "draft_round", lambda *args: rounds.append(real(*args)) or rounds[-1])
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(9))
    enable_chunk_reuse(model, ChunkStore())
    try:
        draft = make_head_draft(model)

        def run():
            out = [model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, draft=kind)
                   for kind in (None, draft)]  # 20 tokens each: where EOS comes depends on the ISA path
            return torch.cat([o.flatten() for o in out])

        fused, plain, taken = fused_and_plain(model, run, fast_loops)
    finally:
        disable_chunk_reuse(model)
    assert torch.equal(fused, plain) and torch.equal(fused[:42], fused[42:])
    drafted = sum(len(r.tokens) for r in rounds if r is not None)
    assert drafted > 0 and taken + drafted >= 40  # every forward of both requests: prefill, steps, drafted rows,
    # verifications


def test_a_copy_is_the_decoders_own_class(tiny_awq, kernels_built):
    model = awq_model("gemma3", tiny_awq, None)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(copied.model) is type(model.model).__bases__[-1]
        assert fuse_decoder(copied) == 1 and isinstance(copied.model, KernelDecoderMixin)


def test_a_streamed_model_runs_the_decoders_forward(tiny_awq, kernels_built, fast_loops):
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="partial_resident", keep_first_k=1, keep_last_k=1,
                     n_staging_slots=1, kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(12))
    fused, plain, taken = fused_and_plain(model, lambda: chunked_logits(model, ids), fast_loops)
    assert taken == 0 and torch.equal(fused, plain)  # its streamed layers' staging hooks must run


def _not_causal(model):
    for layer in model.model.layers:
        layer.self_attn.is_causal = False  # as bidirectional patches (LLM2Vec) set it: a prefill reads every key
    return lambda: [setattr(layer.self_attn, "is_causal", True) for layer in model.model.layers]


def _window_of_one(model):
    previous = model.config.sliding_window
    sliding = [layer.self_attn for layer in model.model.layers if layer.self_attn.sliding_window is not None]
    model.config.sliding_window = 1  # transformers keeps every key then ([-0:]) and masks none
    for attn in sliding:
        attn.sliding_window = 1

    def undo():
        model.config.sliding_window = previous
        for attn in sliding:
            attn.sliding_window = previous
    return undo


class _UnorderedBuffered(BufferedCache):
    """A subclass of an ordered layer's cache whose layers override update: it must say its order again."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.layers = [type("Subclassed", (type(layer),), {"update": type(layer).update})(
            **({"sliding_window": layer.sliding_window} if hasattr(layer, "sliding_window") else {}))
            for layer in self.layers]


class _OwnMaskSizes(DynamicCache):
    def get_mask_sizes(self, query_length, layer_idx):
        return super().get_mask_sizes(query_length, layer_idx)


@pytest.mark.parametrize("case", ["attention not causal", "a window of one", "a subclassed cache layer",
                                  "a cache sizing its own masks"])
def test_what_transformers_computes_otherwise_is_not_taken(case, tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(13))
    undo = {"attention not causal": _not_causal, "a window of one": _window_of_one}.get(case, lambda m: None)(model)
    cache_class = {"a subclassed cache layer": _UnorderedBuffered, "a cache sizing its own masks": _OwnMaskSizes}.get(
        case, DynamicCache)

    def run():
        return prefill_then_steps(model, ids, 20, cache_class)

    try:
        fused, plain, taken = fused_and_plain(model, run, fast_loops)
    finally:
        if undo:
            undo()
    assert taken == 0 and torch.equal(fused, plain)


def test_output_capture_left_on_the_layers_does_not_stop_the_loop(tiny_awq, kernels_built, fast_loops):
    model = awq_model("llama", tiny_awq, None)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        states = model(input_ids=ids, past_key_values=DynamicCache(config=model.config),
                       output_hidden_states=True).hidden_states
    assert len(states) == model.config.num_hidden_layers + 1 and model.model.layers[0]._forward_hooks
    fused, plain, taken = fused_and_plain(
        model, lambda: model(input_ids=ids, past_key_values=DynamicCache(config=model.config)).logits, fast_loops)
    assert taken == 1 and torch.equal(fused, plain)


def test_the_embedding_runs_once_whether_the_call_is_plain_or_not(tiny_awq, kernels_built, fast_loops):
    model = awq_model("gemma3", tiny_awq, None)
    calls = []
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(15))
    try:
        with torch.no_grad():
            model(input_ids=ids, past_key_values=DynamicCache(config=model.config))
            assert len(calls) == 1 and fast_loops["n"] == 1
            shifted = torch.arange(2, 12)[None]  # not plain: found before the embedding runs
            model(input_ids=ids, past_key_values=DynamicCache(config=model.config), position_ids=shifted)
            assert len(calls) == 2 and fast_loops["n"] == 1
    finally:
        handle.remove()


def test_a_fused_model_is_freed_when_deleted(tiny_awq, kernels_built):
    """The plan's witness lives in the decoder and holds nothing that leads back to it: deleting a model that ran a
    fused forward frees it at once, without waiting for the garbage collector."""
    import gc
    import weakref

    model = awq_model("gemma3", tiny_awq, None)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=DynamicCache(config=model.config))
    assert model.model.__dict__.get(plan.WITNESS_ATTR) is not None
    decoder, weight = weakref.ref(model.model), weakref.ref(model.model.embed_tokens.weight)
    gc.disable()
    try:
        del model
        assert decoder() is None and weight() is None
    finally:
        gc.enable()
