"""make_draft: a self-draft from the target's own weights; the target is left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvboost_hf import ControllerSettings, last_request_stats, make_draft
from kvboost_hf.kernels.attention import cpu_attention
from kvboost_hf.models.attention import owned_attention
from kvboost_hf.models.namespace import namespace
from kvboost_hf.models.fused_norm import FusedRMSNorm
from kvboost_hf.speculative.head import DraftHead
from kvboost_hf.speculative.quantized import Int8Linear, quantized_linear
from kvboost_hf.speculative.vocab import draft_vocabulary, token_ranking
from kvboost_hf.streaming import StreamingAWQConfig, streaming_stats
from kvboost_hf.streaming.linear import AWQInt4Linear
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import make_tiny, make_tiny_tokenizer, random_ids, words

pytestmark = pytest.mark.usefixtures("one_thread")


def _texts():
    return [words(random_ids(80, 700 + k)) + " w5 w5 w5 w7" for k in range(3)]


def test_target_is_untouched_and_tensors_are_shared(reuse):
    model = make_tiny("gemma3")
    reuse(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = random_ids(12, 3)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    draft = make_draft(model, bits=4, layers=2, activations=torch.float32)
    assert type(draft).__name__ == "Gemma3ForCausalLM" and not hasattr(draft, "_kvboost_reuse")
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert len(model.model.layers) == 3 and model.config.num_hidden_layers == 3
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert isinstance(draft.model.norm, FusedRMSNorm)  # its own fused module: a scale of a few KB
    linears = [m for m in draft.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears and any(isinstance(m, AWQInt4Linear) for m in draft.modules())
    assert isinstance(draft.lm_head, DraftHead)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), ref)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_bf16_draft_computes_in_bf16_and_leaves_the_target_alone(reuse):
    model = make_tiny("gemma3")
    store = reuse(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = random_ids(12, 3)
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    draft = make_draft(model, bits=4, activations=torch.bfloat16)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert not model.model.embed_tokens._forward_hooks  # the cast hook is the draft's own
    assert draft.draft_name == "int4-bf16"
    assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.norm.weight.dtype == torch.float32
    seen = []
    draft.model.layers[1].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    with torch.no_grad():
        logits = draft(ids).logits
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32
    float_draft = make_draft(model, bits=4, activations=torch.float32)
    assert namespace(draft) != namespace(float_draft)
    # The drafts' attention is ours (the kernel's, or float32 SDPA for bf16 where it is not built: CPU bf16
    # SDPA is slow); the target keeps stock SDPA.
    assert owned_attention(draft.model.layers[0].self_attn) is not None and draft.config._attn_implementation != "sdpa"
    assert not any(owned_attention(m) for m in model.modules())
    assert owned_attention(float_draft) == cpu_attention(torch.float32)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, draft=draft), ref)
    assert store.stats()["entries"] > 0


def test_float32_and_bf16_drafts_never_share_a_namespace():
    """Even when their weights hash the same: bf16-representable weights in a float32 model whose config
    still says bfloat16 (a bf16 checkpoint loaded, then ``.float()``)."""
    model = make_tiny("llama")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.config.dtype = torch.bfloat16
    drafts = {dtype: make_draft(model, bits=8, activations=dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert namespace(drafts[torch.float32]) != namespace(drafts[torch.bfloat16])
    assert drafts[torch.float32].config.dtype == torch.float32


@pytest.mark.parametrize("capabilities, expected", [({"avx512_bf16": True}, torch.bfloat16),
                                                    ({"amx_bf16": True}, torch.bfloat16),
                                                    ({"avx2": True}, torch.float32)])
def test_auto_activations_follow_the_cpu(monkeypatch, capabilities, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
    model = make_tiny("llama")
    seen = []
    draft = make_draft(model, bits=8)
    draft.model.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    with torch.no_grad():
        draft(random_ids(6, 1))
    assert seen == [expected]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linears_are_close_to_float(bits):
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64), torch.randn(48)  # 48 rows: int4 pads to a multiple of 16
    layer = quantized_linear(weight, bias, bits)
    x = torch.randn(5, 64)
    ref = x @ weight.t() + bias
    error = (layer(x) - ref).norm() / ref.norm()
    assert error < (0.12 if bits == 4 else 0.02), error
    assert layer(x).shape == (5, 48) and layer(x).dtype == torch.float32
    if bits == 8:
        assert isinstance(layer, Int8Linear)


def test_restricted_head_is_minus_inf_outside_and_exact_inside():
    model = make_tiny("llama")
    tokens = torch.tensor([2, 5, 9, 40])
    full = DraftHead.build(model.lm_head, 8, 96, None, None)
    restricted = DraftHead.build(model.lm_head, 8, 96, tokens, None)
    hidden = torch.randn(2, 3, 64)
    a, b = full(hidden), restricted(hidden)
    assert b.shape == a.shape == (2, 3, 96)
    outside = torch.ones(96, dtype=torch.bool)
    outside[tokens] = False
    assert torch.isneginf(b[..., outside]).all()
    assert torch.equal(b[..., tokens], a[..., tokens])  # int8 rows are quantized independently
    capped = DraftHead.build(model.lm_head, 8, 96, tokens, 2.0)(hidden)
    assert torch.isneginf(capped[..., outside]).all() and capped[..., tokens].abs().max() <= 2.0


def test_softcapped_model_keeps_minus_inf(reuse):
    model = make_tiny("gemma3")
    model.config.final_logit_softcapping = 5.0
    draft = make_draft(model, bits=8, vocab=20, tokenizer=make_tiny_tokenizer(), texts=_texts())
    assert draft.config.final_logit_softcapping is None and model.config.final_logit_softcapping == 5.0
    logits = draft(random_ids(6, 2)).logits
    assert (torch.isneginf(logits[0, -1]).sum() >= 96 - 23) and logits[0, -1].max() <= 5.0
    ids = random_ids(16, 4)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    reuse(model)
    settings = ControllerSettings(adaptive=False, max_tokens=3, start_tokens=1, probe_tokens=1)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, draft=draft, speculation=settings), ref)


def test_frequency_ranking_is_counted_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HF_CACHE", str(tmp_path))
    tokenizer = make_tiny_tokenizer()
    texts = ["w7 w7 w7 w9 w9 w4", "w9 w7 w11"]
    ranking = token_ranking(tokenizer, 96, texts)
    assert ranking[:4].tolist() == [7, 9, 4, 11] and sorted(ranking.tolist()) == list(range(96))
    assert len(list((tmp_path / "frspec").glob("*.pt"))) == 1
    assert torch.equal(token_ranking(tokenizer, 96, texts), ranking)
    assert len(list((tmp_path / "frspec").glob("*.pt"))) == 1
    assert draft_vocabulary(ranking, 2, always=[2, 0]).tolist() == [0, 2, 7, 9]


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=3), "bits"), (dict(head_bits=16), "head_bits"), (dict(layers=0), "layers"), (dict(layers=9), "layers"),
    (dict(vocab=10), "tokenizer"), (dict(vocab=0, tokenizer=object()), "vocab"),
    (dict(activations=torch.float16), "activations"), (dict(activations="bf16"), "activations"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_draft(make_tiny("llama"), **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_streamed_target_with_resident_int4_draft(family, tmp_path, reuse):
    """A partially resident streamed AWQ target (fp32 compute) and its int4 self-draft: identical output,
    fewer streamed-layer passes than plain decoding."""
    model = make_tiny(family, seed=3, num_layers=6)
    pack_model(model, tmp_path / "ckpt", group_size=32)
    config = StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, n_staging_slots=2)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=config,
                                                  dtype=torch.float32).eval()
    ids = random_ids(24, 8)
    before = streaming_stats(target).acquisitions
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    plain_passes = streaming_stats(target).acquisitions - before
    draft = make_draft(target, bits=4)
    assert not draft._forward_pre_hooks and all(not m._forward_pre_hooks for m in draft.model.layers)
    before = streaming_stats(target).acquisitions
    draft(ids)  # the draft is resident: it never touches the target's staging slots
    assert streaming_stats(target).acquisitions == before
    reuse(target)
    settings = ControllerSettings(adaptive=False, max_tokens=4, start_tokens=1, probe_tokens=1)
    out = target.generate(ids, max_new_tokens=16, do_sample=False, draft=draft, speculation=settings)
    assert torch.equal(out, ref)
    spec = last_request_stats(target).speculation
    assert spec.accepted_tokens > 0
    assert streaming_stats(target).acquisitions - before < plain_passes


def test_streamed_target_needs_bits_4(tmp_path):
    model = make_tiny("llama", seed=3, num_layers=4)
    pack_model(model, tmp_path / "ckpt", group_size=32)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=StreamingAWQConfig(
        residency_mode="full_stream"), dtype=torch.float32)
    with pytest.raises(ValueError, match="bits=4"):
        make_draft(target, bits=8)


def test_int4_draft_linear_many_rows_take_the_dense_path(monkeypatch):
    """Few rows: torch's int4 kernel; from DENSE_MIN_ROWS rows: the codes dequantized to bf16, the same
    weight to bf16 rounding (so the draft's prompt prefill and its decoding agree)."""
    from kvboost_hf.speculative import quantized
    from kvboost_hf.streaming import kernel as linear_module

    torch.manual_seed(1)
    layer = quantized_linear(torch.randn(64, 256), None, 4, kernel="torch")
    assert isinstance(layer, quantized.Int4DraftLinear) and layer.int4_nibbles.shape == (64, 128)
    kernel_rows = []
    real = linear_module.int4_matmul

    def counting(x2, *args):
        kernel_rows.append(x2.shape[0])
        return real(x2, *args)

    monkeypatch.setattr(linear_module, "int4_matmul", counting)
    x = torch.randn(quantized.DENSE_MIN_ROWS, 256)
    dense = layer(x)
    per_row = torch.cat([layer(x[i:i + 1]) for i in range(8)])
    assert kernel_rows == [1] * 8  # the 128-row call never reached the kernel
    assert (dense[:8] - per_row).norm() / per_row.norm() < 0.01
    layer(x[: quantized.DENSE_MIN_ROWS - 1])
    assert kernel_rows[-1] == quantized.DENSE_MIN_ROWS - 1


def test_streamed_draft_reads_its_codes_again(tmp_path):
    """On torch's kernel, every int4 linear of a streamed target's draft (resident or streamed layer) gets
    the checkpoint's codes for its dense path; a checkpoint gone from disk costs only that path."""
    from kvboost_hf.speculative.quantized import DENSE_MIN_ROWS, Int4DraftLinear

    model = make_tiny("llama", seed=3, num_layers=4)
    pack_model(model, tmp_path / "ckpt", group_size=32)
    config = StreamingAWQConfig(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, kernel="torch")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=config,
                                                  dtype=torch.float32).eval()
    draft = make_draft(target, bits=4)
    linears = [m for m in draft.model.layers.modules() if isinstance(m, AWQInt4Linear)]
    assert len(linears) == 4 * 7
    assert all(isinstance(m, Int4DraftLinear) and m.int4_nibbles is not None for m in linears)
    for m in linears:
        x = torch.randn(3, m.in_features, dtype=torch.bfloat16)
        kernel = m(x).float()
        dense = (x @ m.dense_weight().T).float()
        assert (dense - kernel).norm() / kernel.norm() < 0.01
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()
    blind = make_draft(target, bits=4)
    kept = [m for m in blind.model.layers.modules() if isinstance(m, Int4DraftLinear)]
    assert len(kept) == 4 * 7 and all(m.int4_nibbles is None for m in kept)
    with torch.no_grad():
        logits = blind(random_ids(DENSE_MIN_ROWS + 8, 4)).logits  # many rows, on the kernel
    assert torch.isfinite(logits[logits > float("-inf")]).all()


def test_drafts_on_the_kvboost_kernel_need_no_dense_path(tmp_path):
    """kvboost's kernel decodes each weight once per call: a draft keeps no codes and a many-row call
    runs on the kernel, bit for bit what its rows give one at a time."""
    from kvboost_hf import kernels
    from kvboost_hf.speculative.quantized import DENSE_MIN_ROWS, BlockedInt8Linear, Int4DraftLinear

    assert kernels.available().built
    model = make_tiny("llama", seed=3, num_layers=4)
    pack_model(model, tmp_path / "ckpt", group_size=32)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=StreamingAWQConfig(
        residency_mode="partial_resident", keep_first_k=1, keep_last_k=1), dtype=torch.float32).eval()
    draft = make_draft(target, bits=4)
    linears = [m for m in draft.model.layers.modules() if isinstance(m, Int4DraftLinear)]
    assert len(linears) == 4 * 7 and all(m.kernel.name == "kvboost" and m.int4_nibbles is None for m in linears)
    x = torch.randn(DENSE_MIN_ROWS + 3, linears[0].in_features)
    many = linears[0](x)
    assert torch.equal(many[:5], torch.cat([linears[0](x[i:i + 1]) for i in range(5)]))
    assert isinstance(quantized_linear(torch.randn(64, 256), None, 8), BlockedInt8Linear)
