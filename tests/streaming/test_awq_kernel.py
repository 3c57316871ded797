"""AWQ models on kvboost_hf's int4 kernels (``StreamingAWQConfig(kernel=...)``): every residency mode
computes what the resident model computes, the result tracks torch's kernel, and the choice fails
loudly or falls back as documented."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvboost_hf import kernels
from kvboost_hf.kernels.attention import KernelAttention
from kvboost_hf.models.attention import owned_attention
from kvboost_hf.models.fused_norm import FusedRMSNorm
from kvboost_hf.streaming import StreamingAWQConfig, streaming_stats
from kvboost_hf.streaming import kernel as kernel_module
from kvboost_hf.streaming.linear import AWQInt4Linear
from tests.conftest import SLIDING_WINDOW
from tests.streaming.conftest import load_awq


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def kernel_names(model) -> set[str]:
    return {m.kernel.name for m in model.modules() if isinstance(m, AWQInt4Linear)}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_mode_on_the_kvboost_kernel_equals_its_resident_model(family, tiny_awq, mmap_dir, kernels_built):
    _, path = tiny_awq[family]
    reference = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    assert kernel_names(reference) == {"kvboost"}
    # the head runs on the kernels too, its weight still the embedding's where they are tied
    head = reference.get_output_embeddings()
    assert isinstance(head, kernels.KernelLinear)
    if reference.config.tie_word_embeddings:
        assert head.weight is reference.get_input_embeddings().weight
    prompt = _ids(20, 3)
    with torch.no_grad():
        ref_logits = reference(prompt).logits
        ref_tokens = reference.generate(prompt, max_new_tokens=6, do_sample=False)
    for settings in (dict(residency_mode="full_stream", n_staging_slots=1),
                     dict(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, host="mmap"),
                     dict(residency_mode="ffn_only_stream", keep_first_k=1, keep_last_k=1, prefetch=False)):
        model = load_awq(path, mmap_dir=str(mmap_dir), kernel="kvboost", **settings)
        with torch.no_grad():
            assert torch.equal(model(prompt).logits, ref_logits), settings
            assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), ref_tokens), settings


def test_only_the_kvboost_kernel_computes_attention_on_the_kernel_with_fused_norms(tiny_awq, kernels_built):
    _, path = tiny_awq["gemma3"]
    models = {kernel: load_awq(path, residency_mode="full_resident", kernel=kernel) for kernel in ("kvboost", "torch")}
    marked = {kernel: [owned_attention(m) for m in model.modules() if type(m).__name__.endswith("Attention")]
              for kernel, model in models.items()}
    assert marked["kvboost"] and all(isinstance(a, KernelAttention) for a in marked["kvboost"])
    assert not any(marked["torch"])
    assert models["kvboost"].config._attn_implementation == "kvboost_sdpa"  # still, after from_pretrained
    assert models["torch"].config._attn_implementation == "sdpa"
    # and its RMSNorms are fused (one torch.rms_norm each); the torch-kernel model keeps HF's modules
    assert isinstance(models["kvboost"].model.norm, FusedRMSNorm)
    assert not any(isinstance(m, FusedRMSNorm) for m in models["torch"].modules())


def test_kvboost_kernel_tracks_torch_kernel(tiny_awq, kernels_built):
    _, path = tiny_awq["qwen2"]
    ours = load_awq(path, residency_mode="full_resident", kernel="kvboost")
    theirs = load_awq(path, residency_mode="full_resident", kernel="torch")
    assert kernel_names(theirs) == {"torch"}
    prompt = _ids(24, 5)
    with torch.no_grad():
        a, b = ours(prompt).logits.float(), theirs(prompt).logits.float()
    # same weights, different rounding (ours accumulates in float32, torch's in bf16 steps)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_a_converted_mmap_file_of_one_kernel_is_never_read_by_the_other(tiny_awq, tmp_path, kernels_built):
    """The two kernels pack different bytes: the mmap cache is keyed by kernel."""
    _, path = tiny_awq["llama"]
    prompt = _ids(16, 8)
    settings = dict(residency_mode="full_stream", host="mmap", mmap_dir=str(tmp_path))
    with torch.no_grad():
        first = load_awq(path, kernel="torch", **settings)(prompt).logits
        second = load_awq(path, kernel="kvboost", **settings)(prompt).logits
        resident = load_awq(path, residency_mode="full_resident", kernel="kvboost")(prompt).logits
    assert torch.equal(second, resident)
    assert len(list(tmp_path.iterdir())) == 2
    assert not torch.equal(first, second)


def test_kvboost_without_built_kernels_is_an_error_and_auto_falls_back(tiny_awq, monkeypatch):
    _, path = tiny_awq["llama"]
    missing = kernels.KernelStatus(False, None, None, "no C++ compiler")
    monkeypatch.setattr(kernel_module.kernels, "available", lambda: missing)
    with pytest.raises(RuntimeError, match="kernel='kvboost' but the kvboost_hf kernels are not built: no C"):
        load_awq(path, residency_mode="full_resident", kernel="kvboost")
    assert kernel_names(load_awq(path, residency_mode="full_resident")) == {"torch"}


def test_kvboost_off_cpu_is_refused():
    with pytest.raises(ValueError, match="runs on CPU only"):
        kernel_module.resolve_int4_kernel("kvboost", torch.device("meta"))
    assert kernel_module.resolve_int4_kernel("auto", torch.device("meta")).name == "torch"


def verified_and_stepped(model, ids: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    from kvboost_hf.speculative.exact_rows import route_rows, verifying

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :prefix], past_key_values=cache, use_cache=True)
        steps = torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0]
                           for t in range(prefix, ids.shape[1])])
        cache = DynamicCache(config=model.config)
        with verifying(model):
            model(ids[:, :prefix], past_key_values=cache, use_cache=True)
            route_rows(ids.shape[1] - prefix)
            verified = model(ids[:, prefix:], past_key_values=cache, use_cache=True).logits[0]
    return verified, steps


def test_verified_logits_equal_decode_steps_bit_for_bit(tiny_awq, kernels_built):
    """With the head on the kernels too, a verification forward's logits (rows routed through
    attention one by one) equal the decode steps' logits exactly, not only the hidden states."""
    _, path = tiny_awq["gemma3"]
    model = load_awq(path, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, kernel="kvboost",
                     dtype=torch.float32)
    verified, steps = verified_and_stepped(model, _ids(30, 12), 21)
    assert torch.equal(verified, steps)


def test_gemma_verified_logits_equal_decode_steps(gemma_awq, kernels_built):
    """The same on the embedded Gemma (bf16, 262k-row tied head)."""
    model = load_awq(gemma_awq, residency_mode="full_resident", kernel="kvboost")
    ids = torch.randint(10, 20000, (1, 49), generator=torch.Generator().manual_seed(3))
    verified, steps = verified_and_stepped(model, ids, 40)
    assert torch.equal(verified, steps)


def chunked_and_whole(model, ids: torch.Tensor, cuts: list[int]):
    """Logits and K/V of ``ids`` prefilled whole, and in chunks ending at ``cuts`` (plain forwards)."""
    from transformers import DynamicCache

    with torch.no_grad():
        whole_cache = DynamicCache(config=model.config)
        whole = model(ids, past_key_values=whole_cache, use_cache=True).logits[0]
        cache, logits, start = DynamicCache(config=model.config), [], 0
        for end in [*cuts, ids.shape[1]]:
            logits.append(model(ids[:, start:end], past_key_values=cache, use_cache=True).logits[0])
            start = end
    return (torch.cat(logits), cache), (whole, whole_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_computes_the_same_bits_however_it_is_chunked(dtype, tiny_awq, kernels_built):
    """Stored prefill K/V equal a longer prompt's, and a reused prefix plus its suffix's chunk give the
    logits of the whole prompt: every op of a kvboost-kernel model computes rows alone (GEMMs, norms,
    attention), inside and beyond the sliding window."""
    _, path = tiny_awq["gemma3"]
    model = load_awq(path, residency_mode="full_resident", kernel="kvboost", dtype=dtype)
    ids = _ids(SLIDING_WINDOW + 14, 8)
    (logits, cache), (whole, whole_cache) = chunked_and_whole(model, ids, [5, 9, SLIDING_WINDOW + 2])
    assert torch.equal(logits, whole)
    for chunked_layer, whole_layer in zip(cache.layers, whole_cache.layers):
        assert torch.equal(chunked_layer.keys, whole_layer.keys) and torch.equal(chunked_layer.values, whole_layer.values)


def test_gemma_prompt_chunks_give_the_whole_prompts_logits(gemma_awq, kernels_built):
    model = load_awq(gemma_awq, residency_mode="full_resident", kernel="kvboost")
    ids = torch.randint(10, 20000, (1, 80), generator=torch.Generator().manual_seed(5))
    (logits, _), (whole, _) = chunked_and_whole(model, ids, [33, 64])
    assert torch.equal(logits, whole)


@pytest.mark.parametrize("head_tiles", [None, True, False])
def test_the_head_keeps_a_tile_copy_as_configured(head_tiles, tiny_awq, kernels_built):
    """``head_tiles``: a copy of the bf16 head in the tile layout (by default where the amx_bf16 path runs), made
    from the weight as loaded (the tie kept), counted in the stats, and the head's rows still independent."""
    _, path = tiny_awq["gemma3"]
    config = StreamingAWQConfig(residency_mode="full_resident", kernel="kvboost", head_tiles=head_tiles)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config).eval()
    head = model.get_output_embeddings()
    wanted = kernels.current_isa() == "amx_bf16" if head_tiles is None else head_tiles
    assert (head.tiles is not None) == wanted
    assert streaming_stats(model).head_tile_bytes == (head.tiles.numel() * 2 if wanted else 0)
    if wanted:
        assert torch.equal(head.tiles, kernels.tile_layout(head.weight))
    if model.config.tie_word_embeddings:
        assert head.weight is model.get_input_embeddings().weight
    prompt = _ids(12, 5)
    with torch.no_grad():
        logits = model(prompt).logits
        assert torch.equal(model(prompt[:, :8]).logits[0, -1], logits[0, 7])  # 8 rows and 12, row 7 alike
