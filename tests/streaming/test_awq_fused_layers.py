"""Fused decoder layers (``kernels.layer``): two op calls a layer with the bits of the layer's own modules, in
every residency mode, dtype, ISA path and row count, in batches and in ``generate``; the layer's own forward
wherever a module it would bypass is not one the ops reproduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from kvboost_hf import kernels, make_draft
from kvboost_hf.kernels.layer import KernelLayerMixin, fuse_layers, layer_arguments, unfuse_layers
from tests.conftest import make_tiny
from tests.streaming.conftest import STREAM_FAMILIES, load_awq
from tests.streaming.fused_models import assert_fused_equals_unfused, chunked_logits, layer_op_calls

pytestmark = pytest.mark.usefixtures("two_threads")  # the layer ops' column split between threads, as in a real run

@pytest.mark.parametrize("family", STREAM_FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residency", ["full_resident", "full_stream"])
def test_fused_layers_give_the_bits_of_the_layers_modules(family, dtype, residency, tiny_awq, kernels_built):
    settings = dict(n_staging_slots=1) if residency == "full_stream" else {}
    model = load_awq(tiny_awq[family][1], residency_mode=residency, kernel="kvboost", dtype=dtype, **settings)
    layers = model.config.num_hidden_layers
    assert all(isinstance(layer, KernelLayerMixin) for layer in model.model.layers)  # the loader fused them
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    assert_fused_equals_unfused(model, lambda: chunked_logits(model, ids), layers, forwards=5)


def test_every_isa_path_gives_the_modules_bits(tiny_awq, kernels_built):
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 26), generator=torch.Generator().manual_seed(6))
    try:
        for isa in kernels.ISA_LEVELS[: kernels.ISA_LEVELS.index(kernels_built.host_isa) + 1]:
            kernels.select_isa(isa)
            assert_fused_equals_unfused(model, lambda: chunked_logits(model, ids), model.config.num_hidden_layers, 5)
    finally:
        kernels.select_isa(None)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_a_padded_batch_and_generate_give_the_modules_bits(family, tiny_awq, kernels_built):
    model = load_awq(tiny_awq[family][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    assert_fused_equals_unfused(model, lambda: chunked_logits(model, ids, mask), layers, forwards=5)

    def generate():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        return torch.cat([out.sequences.float().flatten(), torch.cat(out.logits).float().flatten()])

    assert_fused_equals_unfused(model, generate, layers, forwards=6)


def test_the_embedded_gemma_int4_model_gives_the_modules_bits(gemma_awq, kernels_built):
    model = load_awq(gemma_awq, residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(10, 20000, (1, 60), generator=torch.Generator().manual_seed(9))
    assert_fused_equals_unfused(model, lambda: chunked_logits(model, ids), model.config.num_hidden_layers, 5)


class Wrapped(nn.Module):
    """A projection behind another module (as an adapter would put it): not one the layer ops reproduce."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_layer_the_ops_cannot_reproduce_runs_its_own_forward(tiny_awq, kernels_built):
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    layers = model.model.layers
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(10))
    expected, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    assert calls == 5 * len(layers)

    seen = []
    handle = layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    got, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    handle.remove()
    assert calls == 5 * (len(layers) - 1) and len(seen) == 5 and torch.equal(got, expected)  # the hook ran

    original = layers[1].mlp.down_proj
    layers[1].mlp.down_proj = Wrapped(original)
    assert layer_arguments(layers[1]) is None
    got, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    layers[1].mlp.down_proj = original
    assert calls == 5 * (len(layers) - 1) and torch.equal(got, expected)
    _, calls = layer_op_calls(lambda: chunked_logits(model, ids))  # the arguments are read again: fused again
    assert calls == 5 * len(layers)

    model.train()
    _, calls = layer_op_calls(lambda: chunked_logits(model, ids))
    model.eval()
    assert calls == 0


def test_a_torch_kernel_model_is_not_fused(tiny_awq, kernels_built):
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="torch", dtype=torch.bfloat16)
    assert not any(isinstance(layer, KernelLayerMixin) for layer in model.model.layers)
    assert fuse_layers(model) == len(model.model.layers)  # fusing it anyway changes nothing: no layer qualifies
    assert all(layer_arguments(layer) is None for layer in model.model.layers)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_an_int4_self_draft_is_fused_and_gives_its_modules_bits(family, kernels_built):
    draft = make_draft(make_tiny(family, seed=4, num_layers=3), bits=4)
    layers = draft.config.num_hidden_layers
    assert all(isinstance(layer, KernelLayerMixin) for layer in draft.model.layers)
    ids = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(11))
    assert_fused_equals_unfused(draft, lambda: chunked_logits(draft, ids), layers, forwards=5)


def test_the_layer_ops_refuse_bad_arguments(tiny_awq, kernels_built):
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    a = layer_arguments(model.model.layers[0])
    hidden = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    head_dim = model.config.head_dim
    cos = torch.ones(1, 3, head_dim, dtype=torch.bfloat16)
    wrong_sides = list(a.inputs(hidden, cos, cos, head_dim))
    wrong_sides[4] = [a.sides[1]] * 3
    with pytest.raises(RuntimeError, match="scales/zeros must be float32"):
        torch.ops.kvboost.layer_attention_inputs(*wrong_sides)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        torch.ops.kvboost.layer_attention_inputs(*a.inputs(hidden, cos.float(), cos.float(), head_dim))
    attn = torch.randn(1, 3, a.outs[0] // head_dim, head_dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="activation must be"):
        torch.ops.kvboost.layer_output(*a.output(hidden, attn)[:-1], "relu")
    hidden.requires_grad_(True)
    out = torch.ops.kvboost.layer_output(*a.output(hidden, attn))
    with pytest.raises(RuntimeError, match="not implemented"):
        out.float().sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_do_not_depend_on_how_many_rows_a_layer_op_computes(dtype, tiny_awq, kernels_built):
    """Few rows take the ops' own loops, many rows torch's vectorized ops: the same bits either way."""
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=dtype)
    layer = model.model.layers[0]
    a, head_dim = layer_arguments(layer), model.config.head_dim
    gen = torch.Generator().manual_seed(12)
    rows = 600  # q: 4 heads x 600 rows x 16, hidden 600 x 64: past the ops' loop limits (32768 for bf16 on AVX-512)
    hidden = torch.randn(1, rows, model.config.hidden_size, generator=gen).to(dtype)
    angles = torch.randn(1, rows, head_dim, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def inputs(i, j):
        return torch.ops.kvboost.layer_attention_inputs(*a.inputs(hidden[:, i:j], cos[:, i:j], sin[:, i:j], head_dim))

    def output(i, j, attn):
        return torch.ops.kvboost.layer_output(*a.output(hidden[:, i:j], attn))

    whole = inputs(0, rows)
    attn = whole[0].transpose(1, 2).contiguous()  # any [B, M, H, D] tensor of the right shape
    out = output(0, rows, attn)
    for i in (0, 7, 599):
        for got, expected in zip(inputs(i, i + 1), whole):
            assert torch.equal(got, expected[:, :, i:i + 1]), i
        assert torch.equal(output(i, i + 1, attn[:, i:i + 1]), out[:, i:i + 1]), i


def test_a_qwen3_self_draft_norms_its_heads_before_rope_as_its_modules_do(kernels_built):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(13)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=256)).eval()
    draft = make_draft(model, bits=4)
    assert all(isinstance(layer, KernelLayerMixin) for layer in draft.model.layers)
    ids = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(14))
    assert_fused_equals_unfused(draft, lambda: chunked_logits(draft, ids), 2, forwards=5)


def test_output_capture_gives_the_modules_outputs_and_keeps_the_layers_fused(tiny_awq, kernels_built):
    """transformers' output capture hooks every layer and attention module the first time a call asks for
    hidden states or attentions, and leaves the hooks installed: the fused layers keep running (they pass
    the attention weights to the capture themselves), and capture what the modules give."""
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(15))

    def hidden_states():
        with torch.no_grad():
            return torch.cat([h.flatten() for h in model(input_ids=ids, output_hidden_states=True).hidden_states])

    def attentions():
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
        return torch.tensor([len(out.attentions or ())]), out.logits

    assert_fused_equals_unfused(model, hidden_states, layers, forwards=1)
    fused, calls = layer_op_calls(attentions)
    unfuse_layers(model)
    plain = attentions()
    fuse_layers(model)
    assert calls == layers and torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert any(m._forward_hooks for m in model.modules())  # the capture's hooks are still there
    assert_fused_equals_unfused(model, lambda: chunked_logits(model, ids), layers, forwards=5)


def test_the_layer_ops_pass_torchs_custom_op_checks(tiny_awq, kernels_built):
    """Schema, fake kernels (shapes and strides for torch.compile), autograd registration, AOT dispatch."""
    model = load_awq(tiny_awq["gemma3"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    a, head_dim = layer_arguments(model.model.layers[0]), model.config.head_dim
    gen = torch.Generator().manual_seed(16)
    hidden = torch.randn(2, 3, model.config.hidden_size, generator=gen).to(torch.bfloat16)
    cos = torch.randn(1, 3, head_dim, generator=gen).to(torch.bfloat16)
    attn = torch.randn(2, 3, a.outs[0] // head_dim, head_dim, generator=gen).to(torch.bfloat16)
    inputs, output = a.inputs(hidden, cos, cos, head_dim), a.output(hidden, attn)
    buffers = torch.randn(2, 2, a.outs[1] // head_dim, 8, head_dim, generator=gen).to(torch.bfloat16)
    step = (*a.step(hidden, cos, cos, head_dim), buffers[0], buffers[1], 1, 4, 0.25, 4)  # writes rows 4..6
    for op, args in ((torch.ops.kvboost.layer_attention_inputs.default, inputs),
                     (torch.ops.kvboost.layer_output.default, output),
                     (torch.ops.kvboost.layer_step.default, step)):
        assert set(torch.library.opcheck(op, args).values()) == {"SUCCESS"}


@pytest.mark.parametrize("setting", [("forward", None), ("streamed", True)])
def test_a_module_that_would_raise_makes_the_fused_layer_raise(setting, tiny_awq, kernels_built):
    """An instance ``forward = None``, or a projection marked streamed by hand (no staging slot): the layer's own
    forward raises, and so does the fused one (it must not compute from what it read before)."""
    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(31))
    chunked_logits(model, ids)
    setattr(model.model.layers[0].self_attn.v_proj, *setting)
    with pytest.raises((TypeError, RuntimeError)):
        chunked_logits(model, ids)


def test_a_fused_model_referenced_from_its_own_hooks_is_freed(tiny_awq, kernels_built):
    """What a fused layer remembers lives on the layer: a hook whose closure holds the model is an ordinary cycle."""
    import gc
    import weakref

    model = load_awq(tiny_awq["llama"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    chunked_logits(model, torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(41)))
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda module, args, out, _model=model: None)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_meta_or_other_dtype_bias_runs_the_layers_own_forward(tiny_awq, kernels_built):
    model = load_awq(tiny_awq["qwen2"][1], residency_mode="full_resident", kernel="kvboost", dtype=torch.bfloat16)
    layer = model.model.layers[0]
    bias = layer.self_attn.q_proj.bias
    layer.self_attn.q_proj.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    assert layer_arguments(layer).bias_dtypes == {torch.float32, torch.bfloat16}
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(18))
    # torch promotes the projection to float32 in the layer's own forward, whose attention then refuses the mix:
    # the fused layer must not compute a bf16 answer instead
    with pytest.raises(RuntimeError, match="must have one dtype"):
        chunked_logits(model, ids)
    layer.self_attn.q_proj.bias = nn.Parameter(torch.empty_like(bias, device="meta"), requires_grad=False)
    assert layer_arguments(layer) is None


def test_mistral_attention_keeps_its_window_on_row_exact_routes(kernels_built):
    """MistralAttention passes the config's sliding window to the attention function: so must a fused layer,
    or a row-exact verification (which takes the window from that argument) reads past it."""
    from kvboost_hf.speculative.exact_rows import route_rows, verifying

    draft = make_draft(make_tiny("mistral", seed=5, num_layers=2), bits=4)  # window 16
    ids = torch.randint(3, 96, (1, 35), generator=torch.Generator().manual_seed(19))

    def verification():
        cache = DynamicCache(config=draft.config)
        with torch.no_grad():
            draft(input_ids=ids[:, :30], past_key_values=cache, use_cache=True)
            with verifying(draft):
                route_rows(5)
                return draft(input_ids=ids[:, 30:], past_key_values=cache, use_cache=True).logits

    assert_fused_equals_unfused(draft, verification, 2, forwards=2)
