"""Chunk reuse on a streamed model, namespaces, streaming counters, and the awq-pack command."""

from __future__ import annotations

import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.cli import main
from kvboost_hf.models.fingerprint import model_namespace
from kvboost_hf.streaming import reset_streaming_stats, streaming_stats
from kvboost_hf.streaming.pack import pack_model
from tests.conftest import make_tiny, make_tiny_tokenizer
from tests.streaming.conftest import TINY_GROUP, TINY_LAYERS, load_awq


def _prompts():
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 96, (1, 40), generator=g)
    return [torch.cat([prefix, torch.randint(3, 96, (1, 8), generator=g)], 1) for _ in range(2)]


def test_chunk_reuse_on_streamed_model_is_exact(tiny_awq):
    _, path = tiny_awq["gemma3"]
    model = load_awq(path, residency_mode="full_stream", n_staging_slots=2)
    first, second = _prompts()
    with torch.no_grad():
        plain = model.generate(second, max_new_tokens=6, do_sample=False)
        enable_chunk_reuse(model, ChunkStore(max_bytes=50_000_000, chunk_size=16))
        try:
            model.generate(first, max_new_tokens=2, do_sample=False)
            reused = model.generate(second, max_new_tokens=6, do_sample=False)
            stats = last_request_stats(model)
        finally:
            disable_chunk_reuse(model)
    assert stats.reused_tokens >= 32  # the shared 40-token prefix (whole chunks at least)
    assert torch.equal(plain, reused)


def test_namespace_keeps_awq_weights_apart(tiny_awq, tmp_path):
    float_model, path = tiny_awq["llama"]
    pack_model(float_model, tmp_path, group_size=TINY_GROUP)  # same model, round-to-nearest
    settings = dict(residency_mode="partial_resident", keep_first_k=1, keep_last_k=1)
    awq, rtn = load_awq(path, **settings), load_awq(tmp_path, **settings)
    namespaces = {model_namespace(float_model), model_namespace(awq), model_namespace(rtn)}
    assert len(namespaces) == 3


def test_counters_and_bounded_staging(tiny_awq):
    _, path = tiny_awq["qwen2"]
    model = load_awq(path, residency_mode="full_stream", n_staging_slots=2)
    stats = streaming_stats(model)
    layer_bytes = stats.streamed_int4_bytes // TINY_LAYERS
    assert stats.staging_bytes == 0  # a CPU computes on the host tensors in place: no slot buffers
    reset_streaming_stats(model)
    with torch.no_grad():
        model.generate(_prompts()[0], max_new_tokens=4, do_sample=False)
    stats = streaming_stats(model)
    assert stats.acquisitions == 4 * TINY_LAYERS
    assert stats.hits + stats.late + stats.misses == stats.acquisitions
    assert stats.bytes_moved == stats.loads * layer_bytes
    assert stats.misses <= 1  # the prefetcher wraps around to the first layer for the next token
    assert 0.0 <= stats.hit_rate <= 1.0 and stats.blocked_ms >= 0.0
    assert set(stats.to_dict()) >= {"hits", "late", "misses", "bytes_moved", "blocked_ms", "hit_rate"}


def test_cpu_streaming_reads_host_tensors_in_place(tiny_awq):
    """No RAM-to-RAM copy on a CPU: the staged weight is the host source's own storage."""
    _, path = tiny_awq["llama"]
    model = load_awq(path, residency_mode="full_stream", n_staging_slots=2)
    source = model._kvboost_streaming.source
    seen = []
    layer = model.model.layers[1]
    hook = layer.register_forward_hook(lambda m, a, o: seen.append(m.mlp.down_proj.staged_weight.data_ptr()),
                                      prepend=True)  # before the streamer releases the slot
    try:
        with torch.no_grad():
            model(_prompts()[0])
    finally:
        hook.remove()
    assert seen == [source.tensor("model.layers.1.mlp.down_proj").data_ptr()]
    assert layer.mlp.down_proj.staged_weight is None  # released after the layer


def test_resident_buffers_and_streamed_modules(tiny_awq):
    _, path = tiny_awq["qwen2"]
    model = load_awq(path, residency_mode="ffn_only_stream", keep_first_k=1, keep_last_k=1)
    layer = model.model.layers[2]
    assert layer.self_attn.q_proj.int4_weight is not None and not layer.self_attn.q_proj.streamed
    assert layer.mlp.down_proj.streamed and layer.mlp.down_proj.int4_weight is None
    assert layer.mlp.down_proj.staged_weight is None  # only inside the layer's forward
    assert not model.model.layers[0].mlp.down_proj.streamed
    names = {n for n, _ in model.named_buffers()}
    assert "model.layers.2.mlp.down_proj.int4_scales_zeros" in names


def test_awq_pack_command(tmp_path):
    src, out = tmp_path / "float", tmp_path / "awq"
    make_tiny("llama", num_layers=3).save_pretrained(src)
    make_tiny_tokenizer().save_pretrained(src)
    calibration = tmp_path / "calib.txt"
    calibration.write_text(" ".join(f"w{i % 90 + 3}" for i in range(64)))
    assert main(["awq-pack", str(src), str(out), "--group-size", "32", "--calibration-file", str(calibration)]) == 0
    model = load_awq(out, residency_mode="partial_resident", keep_first_k=1, keep_last_k=1, n_staging_slots=1)
    assert streaming_stats(model).streamed_layers == 1
    assert (out / "tokenizer.json").exists()


def test_dropped_streamed_model_is_freed(tiny_awq):
    import gc
    import weakref

    model = load_awq(tiny_awq["qwen2"][1], residency_mode="full_stream", n_staging_slots=2)
    with torch.no_grad():
        model.generate(_prompts()[0], max_new_tokens=2, do_sample=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None  # the prefetch thread does not keep it alive
